"""``cuda_utils`` of the CUDA backend: device memory outside torch's caching allocator and
legacy CUDA IPC sharing of device tensors.

The native module hands memory over as DLPack capsules of raw bytes; this thin layer turns
them into typed torch tensors (``torch.from_dlpack`` then ``view(dtype)``), so the wheel
never links libtorch and works with any torch version. torch is imported on first call.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from deepinfer_cuda._native import CudaError
from deepinfer_cuda._native import cuda_utils as _native

if TYPE_CHECKING:
    import torch

#: What ``device`` arguments accept: an index, "cuda"/"cuda:N", a torch.device, or None.
DeviceLike = Union[int, str, "torch.device", None]

__all__ = ["CudaError", "CudaIpcHandle", "alloc_tensor", "export_ipc_tensor", "import_ipc_tensor"]


def _torch() -> Any:
    import torch

    return torch


def _device_index(device: Any) -> int:
    """An int, "cuda", "cuda:N" or torch.device("cuda", N) -> N; anything else is an error."""
    torch = _torch()
    if isinstance(device, bool):
        raise TypeError(f"device must be an int, a str or a torch.device, not {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device} must be >= 0")
        return device
    if isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device={device!r} is not a device: {exc}") from None
        if parsed.type != "cuda":
            raise ValueError(f"device={str(device)!r} is not a CUDA device")
        return parsed.index if parsed.index is not None else torch.cuda.current_device()
    if device is None:
        return torch.cuda.current_device()
    raise TypeError(f"device must be an int, a str or a torch.device, not {type(device).__name__}")


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {type(shape).__name__}") from None
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"shape={shape!r}: every dimension must be an int, got {type(d).__name__}")
        if d < 0:
            raise ValueError(f"shape={shape!r}: dimensions must be >= 0")
    return dims


def _dtype(dtype: Any) -> torch.dtype:
    torch = _torch()
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {dtype!r}")
    return dtype


def _bytes_as(capsule: Any, dtype: torch.dtype) -> torch.Tensor:
    raw = _torch().from_dlpack(capsule)  # 1-D uint8 over the device bytes
    return raw if dtype == raw.dtype else raw.view(dtype)


def alloc_tensor(shape: int | Sequence[int], dtype: torch.dtype, device: DeviceLike = None) -> torch.Tensor:
    """A new uninitialised, contiguous CUDA tensor over memory from ``cuMemAlloc``.

    The memory is outside torch's caching allocator (``torch.cuda.memory_allocated`` does
    not count it) and is freed with ``cuMemFree`` when the tensor and every view of it die.

    shape: an int or a sequence of ints >= 0. dtype: a torch.dtype. device: an int index,
    ``"cuda:N"`` or a ``torch.device`` (None: torch's current device).
    Raises TypeError/ValueError for bad arguments, CudaError when the driver refuses.
    """
    dims = _shape(shape)
    dt = _dtype(dtype)
    index = _device_index(device)
    itemsize = _torch().empty((), dtype=dt).element_size()
    nbytes = math.prod(dims) * itemsize
    return _bytes_as(_native.alloc_bytes(nbytes, index), dt).view(dims)


@dataclass(frozen=True)
class CudaIpcHandle:
    """What ``export_ipc_tensor`` returns: picklable, sent to another process as is."""

    handle: bytes  # cuIpcGetMemHandle of the base allocation
    base_ptr: int  # the allocation's address in the exporting process
    base_nbytes: int
    buffer_id: int  # the allocation's process-wide id in the exporting process
    offset: int  # byte offset of the tensor's first element in the allocation
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, as torch gives them
    dtype: str  # torch dtype name, e.g. "float16"
    device: int  # device index in the exporting process
    device_uuid: bytes
    pid: int  # the exporting process


def _span_bytes(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    if any(d == 0 for d in shape):
        return 0
    return (sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1) * itemsize


def export_ipc_tensor(tensor: torch.Tensor) -> CudaIpcHandle:
    """Share ``tensor`` (any CUDA tensor in memory from cuMemAlloc/cudaMalloc, including a view
    at an offset) with other processes: returns a picklable :class:`CudaIpcHandle`.

    The exporting process must keep the memory alive for as long as any importer uses it.
    Raises TypeError for a non-tensor, ValueError for a CPU or empty tensor and for memory
    legacy CUDA IPC cannot share (PyTorch's expandable segments, cuMemCreate pools).
    """
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(f"tensor is on {tensor.device}, not on a CUDA device")
    if tensor.numel() == 0:
        raise ValueError("tensor has no elements: there is no memory to share")
    index = tensor.device.index
    info = _native.ipc_export(tensor.data_ptr(), index)
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    span = _span_bytes(shape, strides, tensor.element_size())
    if info["offset"] + span > info["base_nbytes"]:
        raise ValueError("tensor extends past the end of its allocation")
    return CudaIpcHandle(
        handle=info["handle"],
        base_ptr=info["base_ptr"],
        base_nbytes=info["base_nbytes"],
        buffer_id=info["buffer_id"],
        offset=info["offset"],
        shape=shape,
        strides=strides,
        dtype=str(tensor.dtype).removeprefix("torch."),
        device=index,
        device_uuid=_native.device_uuid(index),
        pid=os.getpid(),
    )


def import_ipc_tensor(handle: CudaIpcHandle) -> torch.Tensor:
    """The tensor that ``handle`` describes, over the exporter's memory (no copy).

    In another process the allocation is mapped with cuIpcOpenMemHandle, once per process
    (cached and ref-counted; closed when the last imported tensor over it dies). In the
    exporting process itself the original memory is returned. Raises TypeError for a
    non-handle, ValueError when the device is not visible here or the exporter's memory is
    gone (same process), CudaError when the driver cannot map it.
    """
    torch = _torch()
    if not isinstance(handle, CudaIpcHandle):
        raise TypeError(f"handle must be a CudaIpcHandle from export_ipc_tensor, not {type(handle).__name__}")
    dtype = getattr(torch, handle.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"handle.dtype={handle.dtype!r} is not a torch dtype")
    device = _native.device_for_uuid(handle.device_uuid)
    if device < 0:
        raise ValueError(
            f"the exporter's CUDA device (index {handle.device} there) is not visible in this process "
            "(check CUDA_VISIBLE_DEVICES)"
        )
    span = _span_bytes(handle.shape, handle.strides, torch.empty((), dtype=dtype).element_size())
    if handle.pid == os.getpid():
        capsule = _native.wrap_local(
            handle.base_ptr, handle.buffer_id, handle.base_nbytes, handle.offset, span, device
        )
    else:
        capsule = _native.ipc_open(handle.handle, handle.base_nbytes, handle.offset, span, device)
    return _bytes_as(capsule, dtype).as_strided(handle.shape, handle.strides)

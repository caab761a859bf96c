"""``deepinfer._C.cuda_utils``: device memory outside the framework's caching allocator, and IPC.

Served by the backend the plugin registry resolved (``deepinfer env`` shows which); every
backend has these signatures (tests/conformance). On the CUDA backend this layer is Python
over the native module, so this stub is kept by hand: scripts/gen_stubs.py checks that its
parameter names match the reference backend's functions.
"""

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["alloc_tensor", "export_ipc_tensor", "import_ipc_tensor"]

#: An index, ``"cuda"`` / ``"cuda:N"`` (``"npu:N"`` on Ascend), a ``torch.device``, or None
#: for the current device.
DeviceLike = int | str | torch.device | None

def alloc_tensor(
    shape: int | Sequence[int], dtype: torch.dtype, device: DeviceLike = None
) -> torch.Tensor:
    """A new uninitialised, contiguous device tensor over memory from the driver allocator
    (``cuMemAlloc`` / ``aclrtMalloc``), outside torch's caching allocator; freed when the
    tensor and every view of it die. Raises TypeError/ValueError for a bad shape, dtype or
    device, and the backend's error (naming the driver call and code) when allocation fails."""

def export_ipc_tensor(tensor: torch.Tensor) -> Any:
    """A picklable handle to share ``tensor`` with another process: the base allocation's IPC
    handle, the tensor's byte offset in it, shape, strides, dtype, device and the exporting
    pid. Refuses memory the driver cannot share (e.g. expandable segments) with an error that
    says so. The exporter must keep the tensor alive while importers use it."""

def import_ipc_tensor(handle: Any) -> torch.Tensor:
    """The tensor behind ``handle`` in this process. Mappings are cached and ref-counted per
    process and closed when the last tensor over them dies; importing a handle exported by
    this very process returns the original memory."""

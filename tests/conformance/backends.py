"""What the conformance suite needs to know about each backend, and nothing else.

The suite itself is backend-neutral; this file holds, per backend name, how to make its
test environment (the Ascend fake library), how torch reports its tensors' devices, and how
to get a stream and put timed work on it. Add a backend by adding an adapter here.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

_HERE = Path(__file__).resolve().parent


class Adapter:
    """Defaults for a backend whose tensors torch places on ``<device_type>:N``."""

    name = ""
    device_type = ""

    def prepare(self) -> None:
        """Set up the process environment before the probe runs (e.g. point at a fake library)."""

    def tensor_device_type(self) -> str:
        return self.device_type

    def device_str(self, index: int) -> str:
        return f"{self.device_type}:{index}"

    def reports_device_index(self) -> bool:
        """Whether torch tensors from this backend carry the NPU/GPU index."""
        return True

    def torch_device(self, index: int) -> Any:
        """``torch.device(device_type, index)``, or None when this torch does not know the type."""
        import torch

        try:
            return torch.device(self.device_type, index)
        except RuntimeError:  # "npu" exists only once torch_npu is imported
            return None

    def new_stream(self) -> int:
        raise NotImplementedError

    def launch_work(self, stream: int, ms: float) -> float | None:
        """Queue about `ms` of device work on `stream`; return a lower bound of its duration in ms
        that timings must respect, or None when the backend cannot promise one."""
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        """Environment for a helper process that loads the same backend."""
        return dict(os.environ)


class CudaAdapter(Adapter):
    name = "cuda"
    device_type = "cuda"

    def new_stream(self) -> int:
        import torch

        self._streams = getattr(self, "_streams", [])
        stream = torch.cuda.Stream()
        self._streams.append(stream)  # keep it alive for the test
        return int(stream.cuda_stream)

    def launch_work(self, stream: int, ms: float) -> float | None:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(int(ms * 1_000_000))  # cycles; the clock rate is not known here
        return None


class AscendAdapter(Adapter):
    name = "ascend"
    device_type = "npu"

    def __init__(self) -> None:
        self.fake: Path | None = None

    def _fakeacl(self) -> ModuleType:
        path = _HERE.parent / "ascend" / "fake_acl" / "fakeacl.py"
        spec = importlib.util.spec_from_file_location("deepinfer_tests_fakeacl", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def prepare(self) -> None:
        fakeacl = self._fakeacl()
        if fakeacl.use_real_hardware():
            return
        self.fake = fakeacl.build_fake_library()
        os.environ["DEEPINFER_ASCEND_LIBRARY"] = str(self.fake)

    def tensor_device_type(self) -> str:
        # The fake's "device" memory is host memory, handed to torch as CPU tensors.
        return "cpu" if self.fake else "npu"

    def reports_device_index(self) -> bool:
        return self.fake is None

    def _acl(self) -> Any:
        return ctypes.CDLL(os.environ["DEEPINFER_ASCEND_LIBRARY"]) if self.fake else None

    def new_stream(self) -> int:
        if self.fake:
            lib = self._acl()
            stream = ctypes.c_void_p()
            rc = lib.aclrtCreateStream(ctypes.byref(stream))
            assert rc == 0, f"aclrtCreateStream failed with {rc}"
            return int(stream.value or 0)
        import torch_npu

        self._streams = getattr(self, "_streams", [])
        stream = torch_npu.npu.Stream()
        self._streams.append(stream)
        return int(stream.npu_stream)

    def launch_work(self, stream: int, ms: float) -> float | None:
        if self.fake:
            lib = self._acl()
            lib.deepinfer_fake_acl_launch_kernel.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            rc = lib.deepinfer_fake_acl_launch_kernel(
                ctypes.c_void_p(stream or None), int(ms * 1000)
            )
            assert rc == 0
            return ms
        import torch
        import torch_npu

        npu = torch_npu.npu
        ctx = npu.stream(npu.ExternalStream(stream)) if stream else contextlib.nullcontext()
        with ctx:
            a = torch.randn(2048, 2048, device="npu")
            for _ in range(max(1, int(ms))):
                a = a @ a
        return None


ADAPTERS: dict[str, type[Adapter]] = {"cuda": CudaAdapter, "ascend": AscendAdapter}

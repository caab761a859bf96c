"""``deepinfer._C.cuda_utils`` from the backend the registry resolved (see ``deepinfer env``)."""

from deepinfer.plugins.registry import load_backend_submodule

_native = load_backend_submodule("cuda_utils")

alloc_tensor = _native.alloc_tensor
export_ipc_tensor = _native.export_ipc_tensor
import_ipc_tensor = _native.import_ipc_tensor

__all__ = ["alloc_tensor", "export_ipc_tensor", "import_ipc_tensor"]

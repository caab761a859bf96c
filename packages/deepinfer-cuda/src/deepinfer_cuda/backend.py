"""What the plugin's ``load()`` returns: the backend's two submodules.

``cuda_utils`` is the Python layer (torch tensors over the native DLPack capsules);
``graph_timer`` is the native submodule itself (its classes take torch's integer handles).
"""

from deepinfer_cuda import cuda_utils
from deepinfer_cuda._native import graph_timer

__all__ = ["cuda_utils", "graph_timer"]

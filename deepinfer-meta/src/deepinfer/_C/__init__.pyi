"""The unified native namespace: ``engine`` (deepinfer-engine) and, from the resolved
backend wheel, ``cuda_utils`` and ``graph_timer``."""

from deepinfer._C import cuda_utils as cuda_utils
from deepinfer._C import engine as engine
from deepinfer._C import graph_timer as graph_timer

__all__ = ["cuda_utils", "engine", "graph_timer"]

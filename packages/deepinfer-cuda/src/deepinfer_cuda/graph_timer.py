"""``graph_timer`` of the CUDA backend: the native handle classes, unchanged.

``EventHandle`` (a timing event), ``EventRecordNodeHandle`` (an event-record node of a
captured graph) and ``GraphHandle`` (a captured graph and its executable graph). Stream and
graph arguments take torch's integer handles or the torch objects themselves. The
user-facing timer built on them is ``deepinfer_graph_timer.GraphTimer``.
"""

from __future__ import annotations

from deepinfer_cuda._native import CudaError
from deepinfer_cuda._native import graph_timer as _native

EventHandle = _native.EventHandle
EventRecordNodeHandle = _native.EventRecordNodeHandle
GraphHandle = _native.GraphHandle

__all__ = ["CudaError", "EventHandle", "EventRecordNodeHandle", "GraphHandle"]

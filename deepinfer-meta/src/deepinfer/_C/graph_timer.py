"""``deepinfer._C.graph_timer`` from the backend the registry resolved (see ``deepinfer env``)."""

from deepinfer.plugins.registry import load_backend_submodule

_native = load_backend_submodule("graph_timer")

EventHandle = _native.EventHandle
EventRecordNodeHandle = _native.EventRecordNodeHandle
GraphHandle = _native.GraphHandle

__all__ = ["EventHandle", "EventRecordNodeHandle", "GraphHandle"]

"""``deepinfer.timer``: the graph timer of the ``deepinfer-graph-timer`` wheel.

``CUDAGraphTimer`` / ``GraphTimer`` time named regions inside replayed device graphs on
whichever backend ``deepinfer._C.graph_timer`` resolves. The wheel comes with the
``cuda`` and ``ascend`` extras.
"""

try:
    from deepinfer_graph_timer import CUDAGraphTimer, GraphTimer
except ImportError as exc:  # pragma: no cover - exercised in a venv without the wheel
    raise ImportError(
        "deepinfer.timer needs the deepinfer-graph-timer wheel: "
        'pip install "deepinfer[cuda]" (or "deepinfer[ascend]")'
    ) from exc

__all__ = ["CUDAGraphTimer", "GraphTimer"]

"""deepinfer-graph-timer: time named regions inside replayed device graphs.

``GraphTimer`` (alias ``CUDAGraphTimer``) works on any backend's ``graph_timer`` handles;
by default those that ``deepinfer._C.graph_timer`` resolves at run time.
"""

from deepinfer_graph_timer.stats import percentile, summarize
from deepinfer_graph_timer.timer import CUDAGraphTimer, GraphTimer

__version__ = "0.1.0"
__all__ = ["CUDAGraphTimer", "GraphTimer", "__version__", "percentile", "summarize"]

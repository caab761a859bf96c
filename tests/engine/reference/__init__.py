"""Pure-Python reference of the engine's scheduler and block manager (slow, obviously right).

The C++ Scheduler is compared with it step by step (tests/engine/test_core_reference.py).
"""

from .block_manager import RefBlockManager
from .scheduler import RefScheduler

__all__ = ["RefBlockManager", "RefScheduler"]

"""``deepinfer._C.engine``: the C++ engine core of the ``deepinfer-engine`` wheel.

Every public name of the native module is re-exported here unchanged; the rules shared by
many names (borrowed memory, GIL, loose types) are written at the top of ``engine.pyi``.
"""

from deepinfer_engine import _engine as _native
from deepinfer_engine._engine import *  # noqa: F403

__all__ = [name for name in dir(_native) if not name.startswith("_")]

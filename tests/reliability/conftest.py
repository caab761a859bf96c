"""Shared setup of the reliability tests: the engine tests' reference models on sys.path, and the
counter of engine operations the state machine writes (DEEPINFER_STATE_MACHINE_OPS_FILE)."""

from __future__ import annotations

import sys
from pathlib import Path

# tests/engine holds the pure-Python reference scheduler ("reference") and the input-layout
# reference ("inputs_reference"); they are imported, never copied.
_ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
if str(_ENGINE_TESTS) not in sys.path:
    sys.path.insert(0, str(_ENGINE_TESTS))


def pytest_configure(config):
    config.addinivalue_line("markers", "load: runtime load test (bounded in CI by DEEPINFER_LOAD_REQUESTS)")

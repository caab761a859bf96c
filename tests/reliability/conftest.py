"""Shared setup of the reliability tests: the engine tests' reference models on sys.path, and the
counter of engine operations the state machine writes (DEEPINFER_STATE_MACHINE_OPS_FILE)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/engine holds the pure-Python reference scheduler ("reference") and the input-layout
# reference ("inputs_reference"); they are imported, never copied.
_ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
if str(_ENGINE_TESTS) not in sys.path:
    sys.path.insert(0, str(_ENGINE_TESTS))


def pytest_configure(config):
    config.addinivalue_line("markers", "load: runtime load test (bounded in CI by DEEPINFER_LOAD_REQUESTS)")


@pytest.fixture
def sigint_default():
    """Python's own SIGINT handler for the test: a runner started in the background of a
    non-interactive shell ignores SIGINT, which a Ctrl-C test must not inherit."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

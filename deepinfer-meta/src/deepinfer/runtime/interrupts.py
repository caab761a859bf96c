"""Ctrl-C at a safe moment: ``sigint_deferred`` holds a SIGINT back until a block is done.

A bottom-floor module (the standard library only), so that the engine loop and the
tensor-parallel driver can both use it without importing each other.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Deliver a Ctrl-C that arrives inside the block once the block is done (main thread only,
    and only while Python's default SIGINT handler is installed: a custom one is left alone).

    The engine loop builds a step's outputs after the engine took the step's tokens (an interrupt
    there would lose other requests' tokens); the tensor-parallel driver sends a step message and
    runs the step's part (an interrupt between them would leave the other ranks in a collective
    rank 0 never joins)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except ValueError:  # no signal support here
        yield
        return
    if previous is not signal.default_int_handler:
        yield  # a custom handler: leave it alone
        return
    caught: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt

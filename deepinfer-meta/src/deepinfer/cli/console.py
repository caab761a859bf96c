"""What the commands show on the terminal while they work, and how they take Ctrl-C.

- ``status("loading …")``: a status line on stderr with the elapsed time while a slow step runs
  (only when stderr is a terminal; it erases itself when the step ends).
- ``deferred_interrupt()``: Ctrl-C during generation is noted, not raised inside an engine step;
  the caller checks ``.requested`` between steps and stops cleanly. A second Ctrl-C raises
  KeyboardInterrupt at once.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TextIO

#: The status line appears once a step has taken this long (so fast steps print nothing).
STATUS_DELAY_S = 0.5
_FRAMES = "|/-\\"


_showing = threading.Event()  # a status line is on screen: a nested status() stays quiet


@contextmanager
def status(message: str, stream: TextIO | None = None) -> Iterator[None]:
    """Show ``message`` with a spinner and the elapsed seconds until the block ends.

    Nested calls (e.g. a command's "loading" around ``LLM()``'s own) show only the outer one.
    """
    out = stream if stream is not None else sys.stderr
    if _showing.is_set() or not (hasattr(out, "isatty") and out.isatty()):
        yield
        return
    _showing.set()
    done = threading.Event()
    shown = False
    start = time.monotonic()

    def draw() -> None:
        nonlocal shown
        if done.wait(STATUS_DELAY_S):
            return
        frame = 0
        while not done.is_set():
            out.write(f"\r{_FRAMES[frame % len(_FRAMES)]} {message} {time.monotonic() - start:4.1f} s\x1b[K")
            out.flush()
            shown = True
            frame += 1
            done.wait(0.2)

    thread = threading.Thread(target=draw, name="deepinfer-status", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        _showing.clear()
        if shown:
            out.write("\r\x1b[K")
            out.flush()


class DeferredInterrupt:
    """Ctrl-C sets ``requested`` instead of raising; a second Ctrl-C raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def deferred_interrupt() -> DeferredInterrupt:
    """``with deferred_interrupt() as ctrl_c: … if ctrl_c.requested: stop``."""
    return DeferredInterrupt()

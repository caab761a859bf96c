"""The status line the commands show while they load, and Ctrl-C deferred to between steps."""

from __future__ import annotations

import io
import os
import signal
import time

import pytest
from deepinfer.cli.console import deferred_interrupt, status


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _wait_for(stream: io.StringIO, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in stream.getvalue():
        assert time.monotonic() < deadline, f"{text!r} never shown: {stream.getvalue()!r}"
        time.sleep(0.01)


def test_status_line_shows_while_slow_and_erases_itself():
    term = FakeTerminal()
    with status("loading model.gguf", term):
        _wait_for(term, "loading model.gguf")
        with status("inner step", term):  # nested: only the outer line
            time.sleep(0.3)
    shown = term.getvalue()
    assert shown.startswith("\r") and " s\x1b[K" in shown  # spinner, message, elapsed seconds
    assert "inner step" not in shown
    assert shown.endswith("\r\x1b[K")  # erased at the end


def test_status_is_silent_off_a_terminal_and_for_fast_steps():
    pipe = io.StringIO()
    with status("loading", pipe):
        time.sleep(0.1)
    assert pipe.getvalue() == ""
    term = FakeTerminal()
    with status("quick", term):
        pass
    assert term.getvalue() == ""


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_is_deferred_once_then_raised():
    with deferred_interrupt() as ctrl_c:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs at the next bytecode boundary
        assert ctrl_c.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

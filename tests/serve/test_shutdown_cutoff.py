"""Issue 29: requests cut off at the end of --shutdown-timeout get their error: a 503 in the
OpenAI shape, or an error event followed by [DONE] in a stream (not a text/plain 500, not a
stream that simply stops)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
from conftest import MODEL_NAME, ServerThread, wait_until

LONG = {"model": MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 480, "temperature": 0,
        "ignore_eos": True}


def test_requests_cut_off_at_the_shutdown_timeout_get_503_or_an_error_event_then_done(served_llm):
    from deepinfer.serve import ServeConfig, build_app

    app = build_app(served_llm, ServeConfig(served_model_names=[MODEL_NAME]))
    server = ServerThread(app, shutdown_timeout=1.0)
    server.__enter__()
    results: dict[str, Any] = {"stream": []}
    try:
        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True},
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        results["stream"].append(line)

        def whole() -> None:
            results["whole"] = httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=120)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        wait_until(lambda: results["stream"] and server.state.in_flight == 2, 60, "both requests run")
        t0 = time.monotonic()
        server.server.should_exit = True  # what SIGTERM does; 480 tokens outlast the 1 s timeout
        for t in threads:
            t.join(60)
        assert time.monotonic() - t0 < 30
    finally:
        server.__exit__(None, None, None)
    r = results["whole"]
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "shutting down" in err["message"]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    event = json.loads(lines[-2][6:])
    assert "shutting down" in event["error"]["message"] and event["error"]["type"] == "service_unavailable"
    assert len(lines) > 3  # it had streamed tokens before it was cut off

"""``deepinfer serve`` as a process: the address it prints, SIGTERM with requests in flight (the
short one finishes, the long one is cut at --shutdown-timeout with an error event, exit status
0), the access log."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
from conftest import read_until_listening, start_serve_process


def test_sigterm_lets_short_requests_finish_cuts_long_ones_and_exits_0():
    proc = start_serve_process("--shutdown-timeout", "2")
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        # the core says its step budget: on a CPU the LLM() default (serve's own is for CUDA)
        assert any("steps of up to 2048 tokens" in line for line in lines), "".join(lines)
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        reader.start()
        events: dict[str, list[str]] = {"short": [], "long": []}

        def stream(name: str, body: dict) -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json={"model": "m", "stream": True, **body},
                                  timeout=120) as r:
                    for line in r.iter_lines():
                        if line:
                            events[name].append(line)
            except httpx.HTTPError as exc:  # the long one: the server goes away mid-stream
                events[name].append(f"closed: {type(exc).__name__}")

        threads = [threading.Thread(target=stream, args=("short", {"prompt": "One two three", "max_tokens": 12,
                                                                   "temperature": 0})),
                   # one thread decodes float32 at ~50 tok/s (native steps): 480 tokens outlast the 2 s
                   # shutdown timeout many times over; the short one needs ~0.3 s
                   threading.Thread(target=stream, args=("long", {"prompt": "Tell me a story", "max_tokens": 480,
                                                                  "temperature": 0, "ignore_eos": True}))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not (events["short"] and events["long"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert events["short"] and events["long"], "no first chunks"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for t in threads:
            t.join(30)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert events["short"][-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events["short"][:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    # cut at the shutdown timeout, not finished: an error event (503), then [DONE] (issue 29)
    assert events["long"][-1] == "data: [DONE]", events["long"][-3:]
    cut = json.loads(events["long"][-2][6:])["error"]
    assert cut["type"] == "service_unavailable" and "shutting down" in cut["message"]
    assert not any('"finish_reason":"length"' in e for e in events["long"])
    text = "".join(lines)
    access = [line for line in lines if "deepinfer.serve.access" in line and "/v1/completions" in line]
    assert len(access) == 2, text  # one line per request
    short_id = chunks[0]["id"]
    (short_line,) = [line for line in access if short_id in line]
    assert '"POST /v1/completions" 200' in short_line and "completion_tokens=12" in short_line
    assert re.search(r"latency=\d+\.\d+s", short_line)


def test_front_ends_by_default_one_per_eight_cores_at_most_two_and_one_in_process():
    """``--api-server-count`` unset: the rule of the serving guide, on hand-picked core counts,
    and the parsed default resolves to it on this machine (a 2-core CI machine: 1)."""
    import argparse
    import os

    from deepinfer.cli.serve import _check, add_serve_args, default_api_server_count

    assert [default_api_server_count(False, c) for c in (1, 2, 3, 4, 7, 8, 15, 16, 64)] == [1, 1, 1, 1, 1, 1, 1, 2, 2]
    assert default_api_server_count(True, 64) == 1
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args([])
    assert args.api_server_count is None
    _check(args)
    assert args.api_server_count == max(1, min(2, len(os.sched_getaffinity(0)) // 8))
    args = p.parse_args(["--engine-in-process"])
    _check(args)
    assert args.api_server_count == 1

"""The engine-core process and its front ends (issue 25): ``deepinfer serve`` processes on
loopback, the core or a front end killed mid-stream, a client that stops reading, a client that
goes away, N front ends over one engine, and coalesced stream chunks (--stream-interval).

The streams here are read with a plain socket (``RawStream``): a test must know which local port
a stream uses (to find the front end serving it) and must be able to stop reading."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import socket
import threading
import time
from typing import Any

import pytest
from conftest import LLM_KWARGS, metrics, read_until_listening, start_serve_process, wait_until
from deepinfer.runtime.sampling_params import SamplingParams


class RawStream:
    """POST /v1/completions with stream=true over a plain socket; ``events()`` reads its SSE
    data lines until [DONE] or the connection ends."""

    def __init__(self, url: str, body: dict[str, Any], rcvbuf: int | None = None) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        if rcvbuf is not None:  # before connect: the window the server sees stays this small
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(120)
        self.sock.connect((host, int(port)))
        self.local_port = self.sock.getsockname()[1]
        data = json.dumps({"model": "m", "stream": True, **body}).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        self.file = self.sock.makefile("rb")
        self.status = int(self.file.readline().split()[1])
        while self.file.readline() not in (b"\r\n", b""):
            pass  # headers
        self.lines: list[str] = []

    def events(self, limit: int | None = None) -> list[str]:
        """Data lines (without "data: "), ``limit`` more at most; ends at [DONE] or EOF."""
        got = 0
        try:
            while limit is None or got < limit:
                line = self.file.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    self.lines.append(line[6:].strip().decode())
                    got += 1
                    if self.lines[-1] == "[DONE]":
                        break
        except OSError:  # reset by a killed server
            pass
        return self.lines

    def text(self) -> str:
        return "".join(json.loads(e)["choices"][0]["text"] for e in self.lines
                       if e != "[DONE]" and "choices" in json.loads(e) and json.loads(e)["choices"])

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def serving_pid(server_port: int, client_port: int, candidates: list[int]) -> int | None:
    """Which of ``candidates`` holds the server end of the loopback connection from
    ``client_port`` (Linux /proc: the socket's inode, then the process with a descriptor on it)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for row in f.readlines()[1:]:
            cols = row.split()
            local, remote = cols[1], cols[2]
            if int(local.split(":")[1], 16) == server_port and int(remote.split(":")[1], 16) == client_port:
                inode = cols[9]
    if inode is None:
        return None
    for pid in candidates:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
        except OSError:
            continue
    return None


def started(*extra: str) -> tuple[Any, str, list[str]]:
    proc = start_serve_process(*extra)
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, url, lines


def stopped(proc: Any) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
            proc.wait(10)


def pids(lines: list[str], what: str) -> list[int]:
    for line in lines:
        m = re.search(what + r":? pids? ([\d, ]+)", line)
        if m:
            return [int(p) for p in m.group(1).replace(",", " ").split()]
    raise AssertionError(f"no {what} pid in the log:\n" + "".join(lines))


def greedy(reference_llm: Any, prompt: str, n: int) -> str:
    out = reference_llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return str(out[0].outputs[0].text)


def test_the_killed_engine_core_fails_every_stream_503s_health_and_the_server_exits_nonzero_within_5s():
    proc, url, lines = started()
    try:
        (core,) = pids(lines, "engine core")
        streams = [RawStream(url, {"prompt": p, "max_tokens": 480, "ignore_eos": True, "temperature": 0})
                   for p in ("Tell me a story", "Count to a hundred")]
        for s in streams:
            assert s.status == 200 and s.events(1)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        import httpx

        health = []

        def probe() -> bool:
            try:
                health.append(httpx.get(f"{url}/health", timeout=5).status_code)
            except httpx.HTTPError:
                return True  # shut down already
            return health[-1] == 503

        wait_until(probe, 5, "/health answers 503")
        for s in streams:
            events = s.events()
            assert events[-1] == "[DONE]", events[-3:]
            err = json.loads(events[-2])["error"]
            assert err["type"] == "service_unavailable" and "engine core" in err["message"], err
        assert proc.wait(10) != 0
        assert time.monotonic() - killed < 5.0
        assert 503 in health, health
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_n_front_ends_serve_one_engine_with_the_outputs_of_one_and_a_killed_one_leaves_the_others_streams(
        reference_llm):
    proc, url, lines = started("--api-server-count", "2")
    port = int(url.rsplit(":", 1)[1])
    try:
        fronts = pids(lines, "front ends")
        assert len(fronts) == 2
        # streams until both front ends serve at least one (the kernel picks the accepting process)
        prompts = ["Tell me a story", "Count to a hundred", "The capital of France", "Once upon a time",
                   "List the planets", "Say hello"]
        streams: list[tuple[RawStream, str, int | None]] = []
        for i in range(24):
            p = prompts[i % len(prompts)]
            s = RawStream(url, {"prompt": p, "max_tokens": 96, "ignore_eos": True, "temperature": 0})
            assert s.status == 200 and s.events(1)
            streams.append((s, p, serving_pid(port, s.local_port, fronts)))
            if {pid for _, _, pid in streams} >= set(fronts):
                break
        served = {pid for _, _, pid in streams}
        assert served >= set(fronts), f"every stream went to one front end: {served}"
        victim = streams[0][2]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        for s, p, pid in streams:
            events = s.events()
            if pid == victim:
                assert "[DONE]" not in events  # its connection is gone
                continue
            assert events[-1] == "[DONE]", events[-3:]
            assert s.text() == greedy(reference_llm, p, 96)  # the same as one engine alone
        # the engine aborted the dead front end's requests: nothing runs, the blocks are free
        killed = sum(pid == victim for _, _, pid in streams)
        wait_until(lambda: metrics(url).get("deepinfer:num_requests_running", -1) == 0, 10, "nothing runs")
        m = metrics(url)
        assert m["deepinfer:kv_cache_usage_perc"] == 0
        assert m["deepinfer:request_success_total{finished_reason=abort}"] == killed
        assert m["deepinfer:request_success_total{finished_reason=length}"] == len(streams) - killed
        assert proc.poll() is None  # the server serves on
        for s, _, _ in streams:
            s.close()
    finally:
        stopped(proc)
    assert proc.returncode == 0


class FrontEndThread:
    """One front end (uvicorn in a thread of the test) of an engine-core process the test starts,
    on a listening socket whose kernel send buffer is small (accepted connections inherit it), so
    a client that stops reading stalls its stream after a few kB instead of the megabytes the
    kernel's autotuning would take first."""

    def __init__(self, max_stream_buffer: int) -> None:
        import uvicorn
        from deepinfer.serve import ServeConfig, build_app
        from deepinfer.serve.client import CoreProcess, EngineClient

        self.core = CoreProcess({**LLM_KWARGS, "num_threads": 1}, log_level="warning")
        client = EngineClient(self.core.address, self.core.info, max_stream_buffer=max_stream_buffer)
        app = build_app(client, ServeConfig(served_model_names=["m"]))
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), 60, "the front end starts")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
        assert self.core.stop(10) == 0


def test_a_stalled_reader_is_cut_and_counted_while_another_stream_runs_on_and_a_disconnect_frees_blocks(
        reference_llm):
    front = FrontEndThread(max_stream_buffer=8)
    url = front.url
    try:
        # logprobs make each chunk ~1 kB: the socket buffers fill after some tens of tokens
        stalled = RawStream(url, {"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True,
                                  "temperature": 0, "logprobs": 5}, rcvbuf=4096)
        assert stalled.status == 200
        other = RawStream(url, {"prompt": "Count to a hundred", "max_tokens": 200, "ignore_eos": True,
                                "temperature": 0})
        stamps = []
        while not other.lines or other.lines[-1] != "[DONE]":
            if not other.events(1):
                break
            stamps.append(time.monotonic())
        assert other.text() == greedy(reference_llm, "Count to a hundred", 200)
        assert max(b - a for a, b in itertools.pairwise(stamps)) < 3.0  # a stall would be unbounded
        wait_until(lambda: metrics(url).get("deepinfer:stream_buffer_overflows_total", 0) == 1, 60,
                   "the stalled stream is cut")
        m = metrics(url)
        assert m["deepinfer:request_success_total{finished_reason=abort}"] == 1
        assert m["deepinfer:request_success_total{finished_reason=length}"] == 1
        events = stalled.events()  # reading again: what was sent, then the error, then [DONE]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "too slowly" in err["message"]
        # a client that goes away: its request is aborted and its blocks freed
        gone = RawStream(url, {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                               "temperature": 0})
        assert gone.events(2)
        gone.close()
        wait_until(lambda: metrics(url).get("deepinfer:request_success_total{finished_reason=abort}") == 2, 10,
                   "the disconnect aborts")
        wait_until(lambda: metrics(url).get("deepinfer:num_requests_running", -1) == 0, 10, "nothing runs")
        assert metrics(url)["deepinfer:kv_cache_usage_perc"] == 0
        stalled.close()
        other.close()
    finally:
        front.close()


@pytest.mark.parametrize("interval", [1, 4])
def test_coalesced_chunks_join_to_the_non_streamed_text_with_exact_usage(served_llm, interval):
    import httpx
    from conftest import start_server

    with start_server(served_llm, stream_interval=interval) as srv:
        body = {"model": "smollm2", "prompt": "Tell me a story", "max_tokens": 37, "temperature": 0,
                "ignore_eos": True, "logprobs": 1}
        whole = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    usage = chunks[-1]["usage"]
    assert usage == whole["usage"] and usage["completion_tokens"] == 37
    content = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(c["text"] for c in content) == whole["choices"][0]["text"]
    per_chunk = [len(c["logprobs"]["tokens"]) for c in content]
    assert sum(per_chunk) == 37
    assert all(k >= interval for k in per_chunk[:-1]), per_chunk  # only the last may be short
    assert len(per_chunk) <= math.ceil(37 / interval) + (interval > 1)
    assert content[-1]["finish_reason"] == "length"
    assert [t for c in content for t in c["logprobs"]["token_logprobs"]] == \
        whole["choices"][0]["logprobs"]["token_logprobs"]


def test_cli_refuses_bad_front_end_options(capsys):
    from deepinfer.cli import main

    for flags, needle in ((["--api-server-count", "0"], "--api-server-count must be >= 1"),
                          (["--stream-interval", "0"], "--stream-interval must be >= 1"),
                          (["--max-stream-buffer", "0"], "--max-stream-buffer must be >= 1"),
                          (["--max-queue", "-1"], "--max-queue must be >= 0, got -1"),
                          (["--api-key", ""], "--api-key must not be empty"),
                          (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
                          (["--max-stop-strings", "-2"], "--max-stop-strings must be >= 0"),
                          (["--arrival-gap-ms", "-1"], "--arrival-gap-ms must be >= 0"),
                          (["--api-server-count", "2", "--engine-in-process"], "needs the engine-core process")):
        assert main(["serve", "--max-model-len", str(LLM_KWARGS["max_model_len"]), *flags]) == 2
        assert needle in capsys.readouterr().err


def test_structured_outputs_and_tool_calls_cross_to_the_engine_core():
    """A structured request served through the engine-core process (the default layout) is
    constrained there: its output validates against the schema, and a choice is one of them."""


    import httpx
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    proc, url, _lines = started()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 60,
            "temperature": 0.8, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "m", "prompt": "Is the sky blue?", "max_tokens": 8, "guided_choice": ["yes", "no"]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("yes", "no")
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
            "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    finally:
        stopped(proc)


def test_continuous_usage_stats_and_token_ids_through_the_engine_core():
    """A plain stream through the core's front end is written from a fixed chunk template
    (token_stream.py); one asking for vLLM's continuous usage stats gets the usage so far in each
    chunk instead, one asking for return_token_ids each chunk's token ids, and all stream the
    same text."""
    import httpx

    proc, url, _lines = started()
    try:
        body = {"model": "m", "prompt": "Tell me a story", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = {}
        for continuous in (False, True):
            chunks = []
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    **body, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
            got[continuous] = chunks
        plain, counted = got[False], got[True]
        text = ["".join(c["choices"][0]["text"] for c in chunks[:-1]) for chunks in (plain, counted)]
        assert text[0] == text[1] and counted[-1]["usage"]["completion_tokens"] == 12
        assert all(c["usage"] is None for c in plain[:-1])
        counts = [c["usage"]["completion_tokens"] for c in counted[:-1]]
        assert counts == sorted(counts) and counts[-1] == 12 and counts[0] >= 1
        whole = httpx.post(f"{url}/v1/completions", timeout=120, json={**body, "return_token_ids": True}).json()
        ids = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={**body, "stream": True, "return_token_ids": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
        assert len(whole["choices"][0]["token_ids"]) == 12 and ids == whole["choices"][0]["token_ids"]
    finally:
        stopped(proc)

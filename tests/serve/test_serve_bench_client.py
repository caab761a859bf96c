"""The HTTP client of ``bench/serve_bench.py`` (issue 25: the bench measures the server, not its
client): its protocol parses a response however the bytes are cut into reads, refuses what is not
a 200, and counts exactly the tokens a real server streams."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from typing import Any

import pytest
from conftest import ServerThread

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "serve_bench.py")


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("serve_bench_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _chunked_sse(texts: list[str], usage_tokens: int) -> bytes:
    """A streamed completion as uvicorn writes it: headers, then each SSE event in its own
    chunk of the chunked transfer encoding, the usage event, [DONE] and the last chunk."""
    events = [b"data: " + json.dumps({"choices": [{"index": 0, "text": t}]}, separators=(",", ":")).encode()
              + b"\n\n" for t in texts]
    events.append(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": usage_tokens}},
                                         separators=(",", ":")).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    body = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body)


def _feed(bench: Any, pieces: list[bytes], stream: bool = True) -> Any:
    """Run the protocol over ``pieces`` (one ``data_received`` each) on a fresh loop; its result."""
    async def run() -> Any:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        reader = bench.ResponseReader(b"", stream, 0.0, done)
        for p in pieces:
            reader.data_received(p)
        reader.connection_lost(None)
        return await done

    return asyncio.run(run())


def test_a_stream_parses_the_same_cut_anywhere(bench: Any) -> None:
    texts = ["Hello", " wor", "ld", "\u00e9\u00e9", " \\n quoted \\\" too"]
    raw = _chunked_sse(texts, usage_tokens=7)
    whole = _feed(bench, [raw])
    assert whole[0] == 7  # the usage event's count
    assert whole[1] is not None and len(whole[2]) == len(texts) - 1  # first token, then a gap per text event
    for cut in range(1, len(raw)):  # every two-read split
        got = _feed(bench, [raw[:cut], raw[cut:]])
        assert got[0] == 7 and len(got[2]) == len(texts) - 1, cut
    got = _feed(bench, [raw[i:i + 1] for i in range(len(raw))])  # one byte a read
    assert got[0] == 7 and len(got[2]) == len(texts) - 1


def test_a_plain_response_and_a_refusal(bench: Any) -> None:
    body = json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": 5}}).encode()
    raw = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    for cut in range(1, len(raw)):
        got = _feed(bench, [raw[:cut], raw[cut:]], stream=False)
        assert got[0] == 5 and got[1] is not None, cut
    with pytest.raises(RuntimeError, match="429"):
        _feed(bench, [b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\n\r\n"])
    with pytest.raises(RuntimeError, match="closed the connection"):  # cut before [DONE]
        _feed(bench, [_chunked_sse(["a"], 1)[:80]])


def test_counts_what_a_real_server_streams(bench: Any, served_llm: Any) -> None:
    from deepinfer.serve import ServeConfig, build_app

    with ServerThread(build_app(served_llm, ServeConfig(served_model_names=["bench"]))) as server:
        async def run() -> list[Any]:
            prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
            return await asyncio.gather(*(bench._one("127.0.0.1", server.port, p, 6, stream)
                                          for p in prompts for stream in (True, False)))

        results = asyncio.run(run())
    for i, (tokens, ttft, gaps, *_rest) in enumerate(results):
        assert tokens == 6, results  # max_tokens with EOS ignored, from the usage the server sent
        assert ttft is not None and ttft > 0
        if i % 2 == 0:  # streamed: at least one text event, a gap between each two
            assert 0 <= len(gaps) <= 5

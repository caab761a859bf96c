"""A ``deepinfer serve`` front end's CPU per streamed output token, in one process (issue 25).

Runs the real FastAPI app of a front end (``build_app`` over an ``EngineClient``) on N streamed
``/v1/completions`` requests called straight through ASGI (no socket, no uvicorn: the HTTP parse
and the socket writes are not counted), and plays an engine core's part: each step it encodes
the message a core sends (every request's first token as a RequestDelta, then one token each
as columns, the last as a finished RequestDelta) and hands it to the client's decoder and
``_on_message``, then lets the event loop run until every stream has written its chunk. What is
measured: process CPU time (user + system) from the first step to the last stream's end, per
output token — the client's decode, routing, detokenizing (the front end makes the text), the
hand-over to each request's handler, merging, the chunk's JSON and SSE framing.

    python bench/serve_frontend_cpu.py [--streams 256] [--tokens 32] [--runs 5] [--json]
        [--profile FILE]

Compare builds by running them interleaved in separate processes and comparing medians (the
machine this was written on is shared). A tiny random Llama directory is made for its tokenizer
and limits (no model runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_core_cpu import save_tiny_llama

VOCAB = 320


def make_client(model_dir: str, max_num_seqs: int) -> Any:
    from deepinfer.serve.client import EngineClient

    info = {
        "pid": os.getpid(),
        "device": "cpu",
        "model_path": model_dir,
        "max_model_len": 256,
        "max_num_seqs": max_num_seqs,
        "num_blocks": 4096,
        "vocab_size": VOCAB,
        "cache": {
            "block_size": "16",
            "cache_dtype": "float32",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": "4096",
        },
    }
    client = EngineClient("ipc:///nonexistent", info)
    sent: list[Any] = []
    client._send = lambda core, message: sent.append(message)  # type: ignore[method-assign]
    return client, sent


async def one_stream(app: Any, body: bytes, done: asyncio.Event, chunks: list[int]) -> None:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client never goes away before the end
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            chunks[0] += 1

    await app(scope, receive, send)


async def run_once(
    app: Any, client: Any, sent: list[Any], streams: int, tokens: int, profile: Any = None
) -> tuple[float, int]:
    import msgspec
    import numpy as np
    from deepinfer.serve.engine_thread import RequestDelta, SampleDelta

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    chunks = [0]
    rng = np.random.default_rng(0)
    bodies = [
        json.dumps(
            {
                "model": "bench",
                "prompt": rng.integers(3, VOCAB, 16).tolist(),
                "max_tokens": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        for _ in range(streams)
    ]
    sent.clear()
    tasks = [loop.create_task(one_stream(app, b, done, chunks)) for b in bodies]
    while sum(1 for m in sent if m[0] == "add") < streams:  # every request admitted and sent
        await asyncio.sleep(0)
    rids = [m[1] for m in sent if m[0] == "add"]
    core = client._cores[0]
    encoder = msgspec.msgpack.Encoder()
    toks = rng.integers(3, VOCAB, (tokens, streams)).astype("<i4")
    ones = np.ones(streams, "<i4").tobytes()
    if profile is not None:
        profile.enable()
    t0 = time.process_time()
    for step in range(tokens):
        row = toks[step]
        if step == 0 or step == tokens - 1:
            last = step == tokens - 1
            deltas = [
                (
                    rid,
                    RequestDelta(
                        0,
                        [SampleDelta(0, [int(t)], "", None, "length" if last else None, None)],
                        last,
                    ),
                )
                for rid, t in zip(rids, row.tolist(), strict=True)
            ]
            columns: list[Any] = []
        else:
            deltas, columns = [], [(rids, ones, row.tobytes())]
        raw = encoder.encode(("batch", [], deltas, [], columns))
        client._on_message(core, client._decoder.decode(raw))
        for _ in range(4):  # every handler takes its delta and writes its chunk
            await asyncio.sleep(0)
    done.set()
    await asyncio.gather(*tasks)
    cpu = time.process_time() - t0
    if profile is not None:
        profile.disable()
    return cpu, streams * tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", help="cProfile (CPU time) one run into this file")
    args = ap.parse_args()
    from deepinfer.serve.app import ServeConfig, build_app

    with tempfile.TemporaryDirectory() as d:
        save_tiny_llama(d, VOCAB)
        client, sent = make_client(d, args.streams)
        app = build_app(client, ServeConfig(served_model_names=["bench"], max_queue=0))

        async def all_runs() -> list[float]:
            async with app.router.lifespan_context(app):  # (the app's start-up: its GC freeze)
                return await runs()

        async def runs() -> list[float]:
            await run_once(app, client, sent, args.streams, args.tokens)  # warm-up
            if args.profile:
                import cProfile

                prof = cProfile.Profile(time.process_time)
                await run_once(app, client, sent, args.streams, args.tokens, prof)
                prof.dump_stats(args.profile)
                return []
            out = []
            for _ in range(args.runs):
                cpu, toks = await run_once(app, client, sent, args.streams, args.tokens)
                out.append(1e6 * cpu / toks)
            return out

        us = asyncio.run(all_runs())
    if args.profile:
        return 0
    if args.json:
        print(json.dumps({"frontend_us": us}))
    else:
        print(
            f"front end CPU per output token {statistics.median(us):6.2f} us  runs {[round(x, 2) for x in us]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

    python bench/serve_frontend_cpu.py [--streams 256] [--tokens 32] [--prompt-len 16] [--runs 5] [--json]
        [--profile FILE] [--profile-admission FILE] [--plain] [--server asgi|uvicorn] [--step-ms 2]
        [--paths written-here per-step general]

Through ASGI it also reports the admission CPU per request: process CPU time from the requests'
start until every one has been handed to the (fake) engine core, over the number of requests
(body, validation, SamplingParams, the hand-over; no HTTP parse), and the last step's CPU per
request: from the last step's message until every response is sent. ``--plain`` asks for whole
(non-streamed) responses instead, whose last step makes each response's body.

``--server uvicorn`` serves the same app with uvicorn (httptools) on loopback, and a client
process opens the streams over sockets and reads them to ``[DONE]``: the HTTP parse, the socket
writes and uvicorn count too (the steps are played on the server's loop, one due every
``--step-ms`` as an engine's steps come whether or not the front end keeps up: the steps that fell
due while the loop was busy are handled together, as the engine client drains its socket; the
client's own CPU is not counted). ``--paths`` measures the common stream's chunks written by the
engine client (``serve/token_stream.py``, the default: each stream's waiting tokens as one
chunk), the same one chunk per step (``per-step``, as before streams coalesced) and the general
path (that hand-over turned off), alternating run by run in one process.

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


def make_client(model_dir: str, max_num_seqs: int, longest: int = 0) -> Any:
    """A front end's engine client whose core is faked: its messages are kept in ``sent``. It
    admits requests of ``longest`` tokens (prompt + max_tokens), and of 256 whatever that is."""
    from deepinfer.serve.client import EngineClient

    info = {
        "pid": os.getpid(),
        "device": "cpu",
        "model_path": model_dir,
        "max_model_len": max(256, longest),
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
    app: Any, client: Any, sent: list[Any], streams: int, tokens: int, profile: Any = None,
    admission_profile: Any = None, prompt_len: int = 16, stream: bool = True,
) -> tuple[float, int, float, float]:
    import msgspec
    import numpy as np

    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    chunks = [0]
    rng = np.random.default_rng(0)
    bodies = _bodies(streams, tokens, prompt_len, stream)
    sent.clear()
    if admission_profile is not None:
        admission_profile.enable()
    t_admit = time.process_time()
    tasks = [loop.create_task(one_stream(app, b, done, chunks)) for b in bodies]
    while len(sent) < streams:  # every request admitted and sent (nothing else is sent before)
        await asyncio.sleep(0)
    admission = time.process_time() - t_admit
    if admission_profile is not None:
        admission_profile.disable()
    if any(m[0] != "add" for m in sent):
        raise SystemExit(f"the front end sent more than its adds: {sorted({m[0] for m in sent})}")
    rids = [m[1] for m in sent if m[0] == "add"]
    core = client._cores[0]
    encoder = msgspec.msgpack.Encoder()
    toks = rng.integers(3, VOCAB, (tokens, streams)).astype("<i4")
    ones = np.ones(streams, "<i4").tobytes()
    if profile is not None:
        profile.enable()
    t0 = time.process_time()
    t_last = t0
    for step in range(tokens):
        raw = encoder.encode(core_message(rids, toks[step], ones, step, tokens))
        if step == tokens - 1:
            t_last = time.process_time()
        client._on_message(core, client._decoder.decode(raw))
        for _ in range(4):  # every handler takes its delta and writes its chunk
            await asyncio.sleep(0)
    done.set()
    await asyncio.gather(*tasks)
    t_end = time.process_time()
    cpu = t_end - t0
    if profile is not None:
        profile.disable()
    return cpu, streams * tokens, admission / streams, (t_end - t_last) / streams


def core_message(rids: list[str], row: Any, ones: bytes, step: int, tokens: int) -> tuple[Any, ...]:
    """A core's "batch" message for one step of ``tokens``: one token a request (``row``), the
    first and the last step as RequestDeltas (the last finished), the steps between as columns."""
    from deepinfer.serve.engine_thread import RequestDelta, SampleDelta

    if step == 0 or step == tokens - 1:
        last = step == tokens - 1
        deltas = [(rid, RequestDelta(0, [SampleDelta(0, [int(t)], "", None, "length" if last else None, None)],
                                     last)) for rid, t in zip(rids, row.tolist(), strict=True)]
        return ("batch", [], deltas, [], [])
    return ("batch", [], [], [], [(rids, ones, row.tobytes())])


def _bodies(streams: int, tokens: int, prompt_len: int = 16, stream: bool = True) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [json.dumps({"model": "bench", "prompt": rng.integers(3, VOCAB, prompt_len).tolist(), "max_tokens": tokens,
                        "temperature": 0, "ignore_eos": True, "stream": stream}).encode() for _ in range(streams)]


def read_streams(port: int, bodies: list[bytes], out: Any) -> None:
    """(A client process.) Every body POSTed as a stream on its own connection, each read to its
    [DONE]; puts (streams ended with [DONE], SSE events read) on ``out``."""
    import selectors
    import socket

    sel = selectors.DefaultSelector()
    got: dict[Any, bytearray] = {}
    for body in bodies:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sock.setblocking(False)
        got[sock] = bytearray()
        sel.register(sock, selectors.EVENT_READ)
    open_ = len(bodies)
    while open_:
        ready = sel.select(timeout=60)
        if not ready:  # a minute without a byte: report what ended (the caller says which did not)
            break
        for key, _ in ready:
            sock = key.fileobj
            data = sock.recv(1 << 18)
            got[sock] += data
            if not data or b"data: [DONE]" in got[sock][-64:]:
                sel.unregister(sock)
                open_ -= 1
    done = sum(b"data: [DONE]" in g for g in got.values())
    events = sum(g.count(b"data: ") for g in got.values())
    for sock in got:
        sock.close()
    out.put((done, events))


async def play_steps(client: Any, rids: list[str], tokens: int, step_s: float,
                     coalesce: bool = True) -> tuple[float, float]:
    """(On the server's loop.) A core's messages for ``rids``, one token each a step, one step
    every ``step_s`` as a core would send them whether or not the front end keeps up: the
    messages due when the loop comes back are handled together, as the engine client's socket
    drain handles the messages waiting for it, then the streams are flushed once
    (``coalesce``) or after each message (every step its own chunk, as before coalescing). The
    process CPU seconds (user, system) from the first step until every request has left the
    front end (the messages are encoded before)."""
    import msgspec
    import numpy as np

    rng = np.random.default_rng(1)
    core = client._cores[0]
    encoder = msgspec.msgpack.Encoder()
    toks = rng.integers(3, VOCAB, (tokens, len(rids))).astype("<i4")
    ones = np.ones(len(rids), "<i4").tobytes()
    raws = [encoder.encode(core_message(rids, toks[step], ones, step, tokens)) for step in range(tokens)]
    t0 = os.times()
    start = time.monotonic()
    step = 0
    while step < tokens:
        due = min(tokens, int((time.monotonic() - start) / step_s) + 1)
        while step < due:
            client._on_message(core, client._decoder.decode(raws[step]), flush=not coalesce)
            step += 1
        client._flush_streams()
        await asyncio.sleep(max(0.0, start + step * step_s - time.monotonic()))
    while client.in_flight:
        await asyncio.sleep(0.001)
    t1 = os.times()
    return t1.user - t0.user, t1.system - t0.system


def run_uvicorn(args: argparse.Namespace, model_dir: str) -> dict[str, list[float]]:
    """``--server uvicorn``: front-end CPU per token, for each of ``args.paths``, alternating."""
    import multiprocessing
    import threading

    import uvicorn
    from deepinfer.serve.app import ServeConfig, build_app

    client, sent = make_client(model_dir, args.streams, args.prompt_len + args.tokens)
    attach, hold = client.attach_stream, client.hold_tokens
    app = build_app(client, ServeConfig(served_model_names=["bench"], max_queue=0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="on", http="httptools"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    bodies = _bodies(args.streams, args.tokens, args.prompt_len)
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, list[float]] = {p: [] for p in args.paths}
    for i in range(args.runs + 1):  # (the first round warms up)
        for path in args.paths:
            general = path == "general"
            coalesce = path == "written-here"
            client.attach_stream = (lambda rid, stream: False) if general else attach  # type: ignore[method-assign]
            client.hold_tokens = (lambda rid: False) if general else hold  # type: ignore[method-assign]
            sent.clear()
            q = ctx.Queue()
            reader = ctx.Process(target=read_streams, args=(port, bodies, q))
            reader.start()
            deadline = time.monotonic() + 120
            while sum(1 for m in list(sent) if m[0] == "add") < args.streams:
                if not q.empty():  # the client is done before every stream reached the core: refused ones
                    done, _ = q.get()
                    raise SystemExit(f"only {sum(1 for m in list(sent) if m[0] == 'add')} of {args.streams} "
                                     f"streams reached the fake core ({done} ended with [DONE]): the server "
                                     "refused the others (see its log)")
                if time.monotonic() > deadline:
                    raise SystemExit("the streams did not reach the fake core within 120 s")
                time.sleep(0.005)
            rids = [m[1] for m in list(sent) if m[0] == "add"]
            user, system = asyncio.run_coroutine_threadsafe(
                play_steps(client, rids, args.tokens, args.step_ms / 1000, coalesce), client._loop).result(600)
            done, events = q.get(timeout=120)
            reader.join(60)
            if done != args.streams:
                raise SystemExit(f"{args.streams - done} streams did not end with [DONE]")
            if i:
                n = args.streams * args.tokens
                out[path].append(1e6 * (user + system) / n)
                print(f"  {path:12s} run {i}: {out[path][-1]:6.2f} us/token (user {1e6 * user / n:.2f}, system "
                      f"{1e6 * system / n:.2f}; {events} events read)", file=sys.stderr)
    server.should_exit = True
    thread.join(30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16, help="token ids in each request's prompt")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", help="cProfile (CPU time) one run's streaming into this file")
    ap.add_argument("--profile-admission", help="cProfile (CPU time) one run's admission into this file")
    ap.add_argument("--plain", action="store_true",
                    help="(asgi) whole responses instead of streams; also reports the CPU per response from the "
                         "last step's message until every response is sent")
    ap.add_argument("--server", choices=["asgi", "uvicorn"], default="asgi")
    ap.add_argument("--step-ms", type=float, default=2.0, help="(uvicorn) time between two steps")
    ap.add_argument("--paths", nargs="+", choices=["written-here", "per-step", "general"], default=["written-here"],
                    help="(uvicorn) the stream paths to measure, alternating: written-here (the engine client "
                         "writes the common stream, each stream's waiting tokens as one chunk), per-step (the "
                         "same, one chunk per step, as before coalescing), general (the handler task writes)")
    args = ap.parse_args()
    from deepinfer.serve.app import ServeConfig, build_app

    if args.server == "uvicorn":
        with tempfile.TemporaryDirectory() as d:
            save_tiny_llama(d, VOCAB)
            res = run_uvicorn(args, d)
        if args.json:
            print(json.dumps({f"frontend_us_{p}": v for p, v in res.items()}))
        for p, v in res.items():
            print(f"{p:12s} front end CPU per output token {statistics.median(v):6.2f} us  "
                  f"runs {[round(x, 2) for x in v]}")
        return 0

    with tempfile.TemporaryDirectory() as d:
        save_tiny_llama(d, VOCAB)
        client, sent = make_client(d, args.streams, args.prompt_len + args.tokens)
        app = build_app(client, ServeConfig(served_model_names=["bench"], max_queue=0))

        async def all_runs() -> tuple[list[float], list[float], list[float]]:
            async with app.router.lifespan_context(app):  # (the app's start-up: its GC freeze)
                return await runs()

        async def runs() -> tuple[list[float], list[float], list[float]]:
            common: dict[str, Any] = dict(prompt_len=args.prompt_len, stream=not args.plain)
            await run_once(app, client, sent, args.streams, args.tokens, **common)  # warm-up
            if args.profile or args.profile_admission:
                import cProfile

                prof = cProfile.Profile(time.process_time)
                if args.profile:
                    await run_once(app, client, sent, args.streams, args.tokens, profile=prof, **common)
                    prof.dump_stats(args.profile)
                else:
                    await run_once(app, client, sent, args.streams, args.tokens, admission_profile=prof, **common)
                    prof.dump_stats(args.profile_admission)
                return [], [], []
            out, admit, end = [], [], []
            for _ in range(args.runs):
                cpu, toks, per_request, at_end = await run_once(app, client, sent, args.streams, args.tokens,
                                                                **common)
                out.append(1e6 * cpu / toks)
                admit.append(1e6 * per_request)
                end.append(1e6 * at_end)
            return out, admit, end

        us, admit, end = asyncio.run(all_runs())
    if args.profile or args.profile_admission:
        return 0
    if args.json:
        print(json.dumps({"frontend_us": us, "admission_us": admit, "last_step_us": end}))
    else:
        print(
            f"front end CPU per output token {statistics.median(us):6.2f} us  runs {[round(x, 2) for x in us]}"
        )
        print(
            f"admission CPU per request      {statistics.median(admit):6.1f} us  runs {[round(x) for x in admit]}"
        )
        print(
            f"last step's CPU per request    {statistics.median(end):6.1f} us  runs {[round(x) for x in end]}"
            f"  ({'whole responses' if args.plain else 'streams'}: from the last step's message until every "
            "response is sent)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

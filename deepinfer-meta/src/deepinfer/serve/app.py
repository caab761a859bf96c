"""The HTTP routes of ``deepinfer serve`` (FastAPI) over one EngineThread or data-parallel replicas."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.runtime.engine.detokenizer import stop_automaton
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.access_log import AccessLogMiddleware, AccessRecord
from deepinfer.serve.client import EngineClient
from deepinfer.serve.engine_thread import (
    EngineThread,
    RequestDelta,
    RequestFailed,
    SampleDelta,
    arrival_gap_seconds,
    first_sample,
)
from deepinfer.serve.guard import SHUTDOWN_MESSAGE, HostPolicy, RequestGuard, internal_error
from deepinfer.serve.metrics import MetricFamilies, ServerMetrics, cache_info
from deepinfer.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
    check_conversation,
    check_stop,
    check_text,
    completion_prompts,
    parse_body,
    sampling_params,
)
from deepinfer.serve.responses import ResponseBuilder, TokenStrings
from deepinfer.serve.responses import sse_events as _sse
from deepinfer.serve.structured import check_grammar, grammar_compiler, structured_params
from deepinfer.serve.token_stream import TokenStream
from deepinfer.serve.tools import TOOL_CALL_PARSERS, chat_tool_messages, tool_choice

log = logging.getLogger("deepinfer.serve")
T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# Request input (prompt characters, token ids) up to this size is tokenized on the event loop;
# more goes to the input threads (a thread hop costs more than tokenizing a short prompt).
INLINE_INPUT = 4096
INPUT_THREADS = 4


@dataclass
class ServeConfig:
    """What the server needs besides the LLM (the CLI flags of the same names).

    ``host``: the address the server listens on (the Host check accepts its name);
    ``allowed_hosts``: more names the Host header may give (``*``: any); ``max_request_bytes``:
    larger bodies get a 413; ``max_stop_strings``: longer ``stop`` lists get a 400."""

    served_model_names: list[str]
    api_key: str | None = None
    max_queue: int = 1024
    allowed_origins: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    allowed_hosts: list[str] = field(default_factory=list)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_stop_strings: int = 4
    # --- engine core and streams (issue 25) ---
    # stream_interval: a stream chunk waits for this many new tokens of its request (or its end);
    # every token available when a chunk is sent goes into it whatever the interval.
    stream_interval: int = 1
    # arrival_gap_ms: an idle engine waits for requests arriving this close together before its
    # first step (serve/engine_thread.py); None: 3 ms on CPU, 0 elsewhere
    arrival_gap_ms: float | None = None
    # tool_call_parser: the tool-call format of tool_choice auto ("hermes", "llama3_json"), or
    # "auto": chosen from the chat template (serve/tools.py)
    tool_call_parser: str = "auto"


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


class ServingState:
    """The model, the engine (one engine thread, or data-parallel replicas), metrics and the
    admission count, shared by every route.

    ``llm`` is an ``LLM`` (served in this process by an EngineThread) or a ``ReplicaSet`` (the
    replicas' processes serve; it has the tokenizer and limits the routes need)."""

    def __init__(self, llm: Any, config: ServeConfig) -> None:
        if not config.served_model_names:
            raise ValueError("served_model_names must name at least one model")
        if config.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {config.max_queue}")
        if config.api_key == "":
            raise ValueError("api_key must not be empty (None: no key)")
        if config.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {config.max_request_bytes}")
        if config.max_stop_strings < 0:
            raise ValueError(f"max_stop_strings must be >= 0, got {config.max_stop_strings}")
        if isinstance(config.stream_interval, bool) or not isinstance(config.stream_interval, int) \
                or config.stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {config.stream_interval!r}")
        if config.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {config.tool_call_parser!r}")
        from deepinfer.serve.replicas import ReplicaSet

        self.llm, self.config = llm, config
        self.tokenizer = llm.text_tokenizer  # the runtime's (no transformers import)
        name = config.served_model_names[0]
        self.engine: EngineThread | ReplicaSet | EngineClient
        if isinstance(llm, EngineClient):  # --- engine core: this is one front end of it (issue 25) ---
            self.max_model_len: int = llm.max_model_len
            self.vocab_size: int = llm.vocab_size
            self.max_num_seqs: int = llm.max_num_seqs
            per_engine = llm.size > 1  # data-parallel replicas: one engine core each (issue 25)
            families = MetricFamilies(self.max_model_len, per_engine=per_engine)
            llm.attach_metrics([ServerMetrics(name, self.max_model_len, blocks, families,
                                              engine=i if per_engine else None, cache=cache)
                                for i, (blocks, cache) in enumerate(zip(llm.num_blocks, llm.cache_infos,
                                                                        strict=True))])
            self.engine = llm
            self.capacity_rule = (f"{llm.size} replicas x " if per_engine else "") + \
                "max_num_seqs + max_queue, per front end"
            # prompt embeddings (--enable-prompt-embeds): the width the front end checks them against
            self.embeds_hidden_size = int(llm.info.get("hidden_size", 0)) if llm.info.get(
                "enable_prompt_embeds") else 0
        elif isinstance(llm, ReplicaSet):
            self.max_model_len = llm.max_model_len
            self.vocab_size = llm.vocab_size
            self.max_num_seqs = llm.max_num_seqs
            families = MetricFamilies(self.max_model_len, per_engine=True)
            llm.attach_metrics([ServerMetrics(name, self.max_model_len, blocks, families, engine=i, cache=cache)
                                for i, (blocks, cache) in enumerate(zip(llm.num_blocks, llm.cache_infos,
                                                                        strict=True))])
            self.engine = llm
            self.capacity_rule = f"{llm.size} replicas x max_num_seqs + max_queue"
            self.embeds_hidden_size = int(llm.info.get("hidden_size", 0)) if llm.info.get(
                "enable_prompt_embeds") else 0
        else:
            self.max_model_len = llm.engine.cfg.max_model_len
            self.vocab_size = llm.model_config.vocab_size
            self.max_num_seqs = llm.engine.cfg.max_num_seqs
            families = MetricFamilies(self.max_model_len)
            self.engine = EngineThread(llm, ServerMetrics(name, self.max_model_len, llm.engine.cfg.num_blocks,
                                                          families, cache=cache_info(llm)),
                                       arrival_gap_seconds(llm.device.type, config.arrival_gap_ms))
            self.capacity_rule = "max_num_seqs + max_queue"
            self.embeds_hidden_size = int(llm.model_config.hidden_size) if getattr(
                llm.engine_args, "enable_prompt_embeds", False) else 0
        self.metrics = families
        self.strings = TokenStrings(self.tokenizer)
        self.token_ids = self.strings.ids()
        self.capacity = (llm.size if isinstance(llm, ReplicaSet | EngineClient) else 1) * self.max_num_seqs \
            + config.max_queue
        self.in_flight = 0  # engine requests admitted and not yet finished (event-loop thread only)
        # Tokenizing and chat templates run here, off the event loop: a long prompt must not
        # stall every other stream and /health (the tokenizer releases the GIL while it works).
        self.input_pool = ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="deepinfer-input")

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on an input thread, or inline when the input is small (``size``:
        characters or token ids)."""
        if size <= INLINE_INPUT:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.input_pool, functools.partial(fn, *args))

    # ---- checks ----------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def model_name(self, requested: str | None) -> str:
        names = self.config.served_model_names
        if requested is None:
            return names[0]
        if requested not in names:
            raise APIError(404, f"the model {requested!r} does not exist; served models: {', '.join(names)}",
                           "model", "model_not_found")
        return requested

    def admit(self, count: int) -> None:
        if not self.engine.alive:
            raise APIError(503, self.engine.unhealthy_reason() or "the engine is not running")
        if self.in_flight + count > self.capacity:
            raise APIError(503, f"the server is full ({self.in_flight} requests in flight, capacity "
                                f"{self.capacity} = {self.capacity_rule}): retry later")
        self.in_flight += count

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(check_text(prompt, param)).input_ids)
        else:
            if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):  # (C loops: the common case)
                bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
                raise APIError(400, f"token id {bad} is outside the vocabulary (size {self.vocab_size})", param)
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt has no tokens", param)
        return ids

    def max_tokens(self, n_prompt: int, requested: int | None, default: int | None, prompt_param: str,
                   tokens_param: str) -> int:
        """The completion budget; a 400 with both counts when the context cannot hold it."""
        limit = self.max_model_len
        if n_prompt >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                f"{n_prompt} tokens (no room for a completion)", prompt_param,
                           "context_length_exceeded")
        if requested is None:
            return limit - n_prompt if default is None else min(default, limit - n_prompt)
        if requested < 1:
            raise APIError(400, f"{tokens_param} must be >= 1, got {requested}", tokens_param)
        if n_prompt + requested > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but {n_prompt + requested} "
                                f"were requested ({n_prompt} in the prompt, {requested} for the completion)",
                           tokens_param, "context_length_exceeded")
        return requested

    def checked(self, params: SamplingParams) -> SamplingParams:
        seqs = self.max_num_seqs
        if params.n > seqs:  # its samples could never run together
            raise APIError(400, f"n={params.n} is more than the server runs at once (--max-num-seqs {seqs})", "n")
        cap = getattr(getattr(self.llm, "engine_args", None), "max_logprobs", 20)
        cap = 20 if cap < 0 else cap  # --max-logprobs -1: no cap of its own, the API's 20
        if (params.logprobs or 0) > cap or (params.prompt_logprobs or 0) > cap:
            raise APIError(400, f"logprobs={max(params.logprobs or 0, params.prompt_logprobs or 0)} is more than "
                                f"the server allows (--max-logprobs {cap})", "logprobs")
        try:
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            param = "logit_bias" if "logit_bias" in str(exc) else "stop_token_ids"
            raise APIError(400, str(exc).replace("SamplingParams.", ""), param) from None
        return params

    def start(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
              embeds: list[Any] | None = None) -> EngineRun:
        """Admit (503 when full or the engine is down) and submit one engine request per prompt
        (``embeds``: the prompts' embeddings, whose ids are placeholders)."""
        self.admit(len(prompts))
        return EngineRun(self, request_id, prompts, params, embeds)


class DeltaSink(asyncio.Queue[Any]):
    """The queue of one HTTP request's deltas: unbounded, read by its handler alone. The same
    methods as ``asyncio.Queue`` without the task accounting and the waiter queues (a put and a
    get per token and stream: asyncio.Queue's cost ~10 Python calls a token)."""

    def __init__(self) -> None:
        super().__init__()
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return False

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> Any:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # (cancelled while waiting)
                    self._waiter = None
        return self._items.popleft()


class EngineRun:
    """The engine requests of one HTTP request: an async iterator of their deltas.

    ``close()`` (idempotent, also on garbage collection) aborts whatever has not finished and
    gives the admission slots back; every path out of a handler calls it.
    """

    def __init__(self, state: ServingState, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], embeds: list[Any] | None = None) -> None:
        self._state = state
        self._count = len(prompts)
        self._sink: asyncio.Queue[Any] = DeltaSink()
        self._ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._unfinished = set(self._ids)
        self._closed = False
        self._failure: APIError | None = None
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            if embeds is None:
                state.engine.submit(self._ids[i], p, sp, self._sink, i)
            else:
                state.engine.submit(self._ids[i], p, sp, self._sink, i, prompt_embeds=embeds[i])

    @property
    def sink(self) -> asyncio.Queue[Any]:
        return self._sink

    @property
    def request_ids(self) -> list[str]:
        """The engine request ids, one per prompt."""
        return self._ids

    def __aiter__(self) -> EngineRun:
        return self

    async def __anext__(self) -> RequestDelta:
        if not self._unfinished:
            self.close()
            raise StopAsyncIteration
        item = await self._sink.get()
        if isinstance(item, RequestFailed):
            self._unfinished.discard(self._ids[item.tag])
            self.close()
            raise APIError(item.status, item.message)
        if item.finished:
            self._unfinished.discard(self._ids[item.tag])
        return item

    # --- coalesced streams (issue 25) ---
    async def batch(self, min_tokens: int = 1) -> list[RequestDelta]:
        """Every delta available now, merged per prompt (one delta per prompt with all its new
        tokens), waiting until they hold ``min_tokens`` new tokens or every request has ended;
        [] at the end. A failure raises its APIError after the deltas before it were returned."""
        items: list[RequestDelta] = []
        tokens = 0
        while True:
            try:
                got = await self.take()
            except APIError as err:
                if not items:
                    raise
                self._failure = err
                return merge_deltas(items)
            items += got
            tokens += sum(len(smp.token_ids) for item in got for smp in item.samples)
            if not got or tokens >= min_tokens or not self._unfinished:
                return merge_deltas(items)

    async def take(self) -> list[Any]:
        """Everything in the sink now, as it came (SSE events as bytes from a ``TokenStream``,
        deltas), waiting for one; [] at the end. A failure raises its APIError after the items
        before it were returned."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if not self._unfinished:
            self.close()
            return []
        items: list[Any] = []
        item = await self._sink.get()
        while True:
            if isinstance(item, RequestFailed):
                self._unfinished.discard(self._ids[item.tag])
                self.close()
                err = APIError(item.status, item.message)
                if not items:
                    raise err
                self._failure = err
                return items
            items.append(item)
            if isinstance(item, RequestDelta) and item.finished:
                self._unfinished.discard(self._ids[item.tag])
            if self._sink.empty():
                return items
            item = self._sink.get_nowait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in self._unfinished:
            self._state.engine.abort(rid)
        self._unfinished.clear()
        self._state.in_flight -= self._count

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - __del__ must not raise (e.g. at interpreter exit)
            pass


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (the shutdown timeout): the work ends too, its requests aborted
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


async def _event_stream(request: Request, chunks: AsyncIterator[Any], record: AccessRecord,
                        close: Callable[[], None]) -> AsyncIterator[bytes]:
    """SSE framing of ``chunks``; ends as soon as the client goes away, whether or not a chunk is
    due. An error, a failure of the server's own (its id logged once) or the cut-off at the end
    of --shutdown-timeout (uvicorn cancels the task) becomes an error event, then ``[DONE]``.
    ``close`` (synchronous: cleanup must not await) aborts the requests on every way out.

    The next chunk is awaited in this task; a disconnect while it waits cancels the task (and is
    told from uvicorn's cancel by ``gone``). (A task and an ``asyncio.wait`` per chunk, racing the
    chunk against the disconnect, cost ~2.5x the CPU of the whole hand-over per chunk.)"""
    task = asyncio.current_task()
    state = {"waiting": False, "gone": False}

    def on_disconnect(fut: asyncio.Future[None]) -> None:
        if fut.cancelled():
            return
        fut.exception()  # (a receive that failed counts as gone, as before; retrieved here)
        state["gone"] = True
        if state["waiting"] and task is not None:
            task.cancel()  # wakes the wait for the next chunk (told from a cut-off by "gone")

    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(on_disconnect)
    try:
        while True:
            if state["gone"]:  # (gone while a chunk was written)
                record.note = "client disconnected"
                return
            state["waiting"] = True
            try:
                chunk = await chunks.__anext__()
            except asyncio.CancelledError:
                if state["gone"]:
                    uncancel = getattr(task, "uncancel", None)  # (Python >= 3.11 counts cancels)
                    if uncancel is not None:
                        uncancel()
                    record.note = "client disconnected"
                    return
                record.note = "cut off at shutdown"
                yield _sse(APIError(503, SHUTDOWN_MESSAGE).body())
                break
            except StopAsyncIteration:
                break
            except APIError as exc:
                record.note = f"error {exc.status}"
                yield _sse(exc.body())
                break
            except Exception as exc:  # an error event, never a stream that just stops
                error_id = f"err-{uuid.uuid4().hex[:16]}"
                log.exception("unhandled error %s in the stream of %s", error_id, record.request_id)
                record.note = f"error 500 {error_id}"
                yield _sse(internal_error(error_id, exc).body())
                break
            finally:
                state["waiting"] = False
            yield _sse(chunk)
        yield b"data: [DONE]\n\n"
    finally:
        state["waiting"] = False
        watcher.remove_done_callback(on_disconnect)
        watcher.cancel()
        close()


class EventStream(Response):
    """A ``text/event-stream`` response sent straight from ``events``.

    Not Starlette's StreamingResponse: under an ASGI 2.3 server that one runs the body in an
    anyio task group whose cancel scope cancels every later await once uvicorn cancels the
    request at the end of --shutdown-timeout, so the stream could not send its closing error
    event. Disconnects are ``_event_stream``'s business (it watches ``receive`` itself)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_start: Callable[[Any], None] | None = None) -> None:
        self.events = events
        self.on_start = on_start  # called with the server's ``receive`` once the response started
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.on_start is not None:
            self.on_start(receive)
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while a chunk was sent
            pass
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


def build_app(llm: Any, config: ServeConfig) -> FastAPI:
    """The FastAPI app serving ``llm``, an ``LLM`` or a ``ReplicaSet`` (its engine thread, or the
    replicas' readers, start with the app; both stop with it)."""
    state = ServingState(llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        # What exists now (the modules, the model, the app) lives as long as the server: out of
        # the garbage collector's sight, a full collection walks only what serving makes (one
        # over a front end's start-up objects cost ~25 us per streamed token of the 8k tokens
        # between two such collections: bench/serve_frontend_cpu.py).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()  # (a process that builds several apps, e.g. the tests, collects them again)
            await asyncio.to_thread(state.engine.stop)
            state.input_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = state
    # outermost first: access log, guard (Host, Origin, catch-all), CORS, the routes
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # With credentials a browser takes only the request's own Origin echoed back, never "*":
        # "*" is given to Starlette as a pattern matching any origin, so it echoes each one.
        any_origin = "*" in config.allowed_origins
        app.add_middleware(CORSMiddleware, allow_origins=[] if any_origin else config.allowed_origins,
                           allow_origin_regex=".*" if any_origin else None, allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(RequestGuard, hosts=HostPolicy(config.host, config.allowed_hosts),
                       allowed_origins=config.allowed_origins)
    app.add_middleware(AccessLogMiddleware)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        request.state.access.note = "client disconnected"
        return Response(status_code=499)

    async def body_of(request: Request, model: Any) -> Any:
        """The request's JSON body validated as ``model``: 401 (key), 415 (not JSON: a browser
        sends text/plain and form bodies without asking first), 413 (over --max-request-bytes,
        from Content-Length or while a chunked body arrives), 400 (malformed)."""
        state.authorize(request)
        ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
            raise APIError(415, "the request body must be JSON sent with 'Content-Type: application/json', got "
                                f"{ctype or 'no Content-Type'!r}", code="unsupported_media_type")
        limit = config.max_request_bytes
        too_large = APIError(413, f"the request body is larger than this server takes ({limit} bytes, "
                                  "--max-request-bytes)", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
        body = b"".join(parts)
        try:
            raw = json.loads(body)
        except RecursionError:
            raise APIError(400, "the request body is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        return parse_body(model, raw)

    # ---- plain routes ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        reason = state.engine.unhealthy_reason()
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse(APIError(503, reason).body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        import deepinfer

        try:
            engine = dist_version("deepinfer-engine")
        except PackageNotFoundError:
            engine = "0+dev"
        return {"version": deepinfer.__version__, "engine_version": engine}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.authorize(request)
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "deepinfer",
             "root": str(llm.model_path), "max_model_len": state.max_model_len}
            for name in config.served_model_names]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await body_of(request, TokenizeRequest)
        state.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            messages = chat_messages(req.messages)
            ids = await state.off_loop(_chat_size(messages), _chat_ids, state, messages, req.add_generation_prompt)
        else:
            prompt = check_text(req.prompt, "prompt")
            ids = await state.off_loop(len(prompt), lambda: list(
                state.tokenizer(prompt, add_special_tokens=req.add_special_tokens).input_ids))
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await body_of(request, DetokenizeRequest)
        state.model_name(req.model)
        def decode() -> str:
            if req.tokens:
                state.prompt_ids(req.tokens, "tokens")  # 400 for ids outside the vocabulary
            return str(state.tokenizer.decode(req.tokens))

        return {"prompt": await state.off_loop(len(req.tokens), decode)}

    # ---- generation ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await body_of(request, CompletionRequest)
        name = state.model_name(req.model)
        check_stop(req.stop, config.max_stop_strings)
        embeds = None
        if req.prompt_embeds is not None:  # vLLM's: prompts as embeddings
            embeds, prompts = await _embeds_prompts(state, req)
            raw = []
        else:
            raw = completion_prompts(req.prompt)
            prompts = await state.off_loop(sum(len(p) for p in raw),
                                           lambda: [state.prompt_ids(p, "prompt") for p in raw])
        echo_lp = req.logprobs if req.echo else None  # the prompt's logprobs come first
        params = [state.checked(sampling_params(
            req, state.max_tokens(len(p), req.max_tokens, 16, "prompt", "max_tokens"), req.logprobs, {},
            prompt_logprobs=echo_lp)) for p in prompts]
        await _structured_outputs(state, req, params, None)
        await _build_stop_automaton(state, params[0])
        echo = None
        if req.echo:  # the prompt as given; token ids decoded
            echo = await state.off_loop(sum(len(p) for p in raw), lambda: [
                p if isinstance(p, str) else str(state.tokenizer.decode(p)) for p in raw])
        builder = ResponseBuilder("completion", f"cmpl-{uuid.uuid4().hex}", name, req.n,
                                  [len(p) for p in prompts], _strings(state, req), req.logprobs,
                                  echo=echo, prompt_ids=prompts if echo is not None else None)
        return await _respond(request, state, builder, prompts, params, req, embeds)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
        name = state.model_name(req.model)
        check_stop(req.stop, config.max_stop_strings)
        tools = tool_choice(req, getattr(state.tokenizer, "chat_template", None), config.tool_call_parser)
        messages = chat_messages(chat_tool_messages(req.messages))
        check_conversation(messages)
        prompt = await state.off_loop(_chat_size(messages), _chat_ids, state, messages, req.add_generation_prompt,
                                      None if tools is None else tools.template_tools)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = (req.top_logprobs or 0) if req.logprobs else None
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        budget = state.max_tokens(len(prompt), requested, None, "messages", tokens_param)
        params = state.checked(sampling_params(req, budget, top, {"logprobs": "top_logprobs",
                                                                  "max_tokens": tokens_param}))
        await _structured_outputs(state, req, [params], tools)
        await _build_stop_automaton(state, params)
        builder = ResponseBuilder("chat", f"chatcmpl-{uuid.uuid4().hex}", name, req.n, [len(prompt)],
                                  _strings(state, req), top)
        builder.tools = tools
        return await _respond(request, state, builder, [prompt], [params], req)

    return app


def _chat_size(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"]) + len(m["role"]) for m in messages)


async def _build_stop_automaton(state: ServingState, params: SamplingParams) -> None:
    """Build (and cache) the stop strings' automaton here, off the engine thread, when it is
    large (an operator raised --max-stop-strings); the engine thread finds it built."""
    stops = tuple(params.stop or ())
    size = sum(len(s) for s in stops)
    if size > INLINE_INPUT:
        await state.off_loop(size, stop_automaton, stops)


def _strings(state: ServingState, req: Any) -> TokenStrings:
    return state.token_ids if req.return_tokens_as_token_ids else state.strings


async def _structured_outputs(state: ServingState, req: Any, params: list[SamplingParams], tools: Any) -> None:
    """Set the request's output constraint (response_format, vLLM's structured_outputs /
    guided_*, or a forced tool call) on ``params``; its grammar is compiled here, off the event
    loop, so an invalid schema is a 400 naming its field."""
    so, param = structured_params(req)
    forced = None if tools is None else tools.structured()
    if forced is not None:
        if so is not None:
            raise APIError(400, f"{param} cannot constrain the output of a forced tool call (tool_choice "
                                f"{tools.mode!r})", param)
        so, param = forced, "tools"
    if so is None:
        return
    await state.off_loop(1 << 20, check_grammar, grammar_compiler(state), so, param)
    for p in params:
        p.structured_outputs = so


def _chat_ids(state: ServingState, messages: list[dict[str, str]], add_generation_prompt: bool,
              tools: list[dict[str, Any]] | None = None) -> list[int]:
    try:
        kwargs = None if tools is None else {"tools": tools}
        ids = state.llm.apply_chat_template(messages, add_generation_prompt, kwargs)["prompt_token_ids"]
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), "messages") from None
    if not ids:
        raise APIError(400, "the formatted conversation has no tokens", "messages")
    return list(ids)


async def _embeds_prompts(state: ServingState, req: Any) -> tuple[list[Any], list[list[int]]]:
    """(the checked tensors, their placeholder ids) of a completions request's prompt_embeds."""
    from deepinfer.runtime.engine.prompt_embeds import placeholder_ids
    from deepinfer.serve.protocol import decode_prompt_embeds

    if not state.embeds_hidden_size:
        raise APIError(400, "prompt_embeds needs a server started with --enable-prompt-embeds", "prompt_embeds")
    if req.prompt is not None:
        raise APIError(400, "give prompt or prompt_embeds, not both", "prompt_embeds")
    if req.echo:
        raise APIError(400, "echo needs a prompt of text or token ids, not prompt_embeds", "echo")
    value = req.prompt_embeds
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    size = sum(len(x) for x in items if isinstance(x, str))  # base64 characters: decoded off the loop when large

    def decode() -> tuple[list[Any], list[list[int]]]:
        tensors = decode_prompt_embeds(req.prompt_embeds, state.embeds_hidden_size, state.max_model_len)
        return tensors, [placeholder_ids(t, state.vocab_size) for t in tensors]

    return await state.off_loop(size, decode)


async def _respond(request: Request, state: ServingState, builder: ResponseBuilder, prompts: list[list[int]],
                   params: list[SamplingParams], req: Any, embeds: list[Any] | None = None) -> Response:
    record: AccessRecord = request.state.access
    record.request_id = builder.id
    record.prompt_tokens = builder.prompt_tokens
    deltas = state.start(builder.id, prompts, params, embeds)
    engine = state.engine
    if not req.stream:
        if isinstance(engine, EngineClient):  # the tokens wait in the engine client (one wake-up)
            for rid in deltas.request_ids:
                engine.hold_tokens(rid)
        async def collect() -> dict[str, Any]:
            try:
                async for delta in deltas:
                    builder.apply(delta)
            finally:
                record.completion_tokens = builder.completion_tokens
                deltas.close()
            return builder.body()

        return JSONResponse(await _unless_disconnected(request, collect()))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    interval = state.config.stream_interval
    if (isinstance(engine, EngineClient) and len(prompts) == 1 and builder.n == 1 and builder.top is None
            and builder.echo is None and builder.tools is None):  # the common stream (token_stream.py)
        template = builder.text_chunk_template(include_usage)
        if template is not None:
            stream = TokenStream(*template, interval, builder.choices[0], deltas.sink)
            if engine.attach_stream(deltas.request_ids[0], stream):
                return _token_stream(request, state, builder, deltas, stream, include_usage)

    async def chunks() -> AsyncIterator[Any]:  # --- coalesced: one write per batch (issue 25) ---
        if builder.kind == "chat":
            yield builder.role_chunks(include_usage)
        while batch := await deltas.batch(interval):
            out = [c for delta in batch for c in builder.delta_chunks(delta, include_usage)]
            if out:
                yield out
        if include_usage:
            yield builder.usage_chunk()

    def close() -> None:
        record.completion_tokens = builder.completion_tokens
        deltas.close()

    return EventStream(_event_stream(request, chunks(), record, close))



def _token_stream(request: Request, state: ServingState, builder: ResponseBuilder, deltas: EngineRun,
                  stream: TokenStream, include_usage: bool) -> Response:
    """A stream whose text chunks the engine client writes (token_stream.py): this handler sends
    the opening and closing chunks, and any events queued when the server's transport is not
    reachable."""
    record: AccessRecord = request.state.access

    async def chunks() -> AsyncIterator[Any]:
        if builder.kind == "chat":
            yield builder.role_chunks(include_usage)
        while True:
            stream.go_direct()  # (only once nothing waits in the sink)
            items = await deltas.take()
            if not items:
                break
            out = []
            for item in items:
                if isinstance(item, bytes):
                    out.append(item)
                    continue
                held = stream.take_held()  # (--stream-interval) text before the last delta's
                if held:
                    first = first_sample(item)
                    first.text = held + first.text
                out.append(_sse(builder.delta_chunks(item, include_usage)))
            yield b"".join(out)
        if include_usage:
            yield builder.usage_chunk()

    def close() -> None:
        record.completion_tokens = builder.completion_tokens
        deltas.close()

    return EventStream(_event_stream(request, chunks(), record, close), on_start=stream.use_connection)


# --- coalesced streams (issue 25) ---
def merge_deltas(items: list[RequestDelta]) -> list[RequestDelta]:
    """Consecutive deltas of one HTTP request merged per prompt (tag), in order: each sample's
    tokens, text and logprobs joined, its finish reason the last one given. One delta comes back
    as it is (nothing merges into it: no copy, the common case of a stream that keeps up)."""
    if len(items) == 1:
        return items
    merged: dict[int, RequestDelta] = {}
    for d in items:
        m = merged.get(d.tag)
        if m is None:
            merged[d.tag] = RequestDelta(d.tag, [_copy_sample(x) for x in d.samples], d.finished,
                                         None if d.prompt_logprobs is None else list(d.prompt_logprobs),
                                         d.cached_tokens)
            continue
        by_index = {x.index: x for x in m.samples}
        for x in d.samples:
            t = by_index.get(x.index)
            if t is None:
                m.samples.append(_copy_sample(x))
                continue
            t.token_ids.extend(x.token_ids)
            t.text += x.text
            if x.logprobs is not None:
                t.logprobs = (t.logprobs or []) + list(x.logprobs)
            if x.finish_reason is not None:
                t.finish_reason, t.stop_reason = x.finish_reason, x.stop_reason
        if d.prompt_logprobs:
            m.prompt_logprobs = (m.prompt_logprobs or []) + list(d.prompt_logprobs)
        if d.finished:
            m.finished = True
            m.cached_tokens = d.cached_tokens
    return list(merged.values())


def _copy_sample(x: SampleDelta) -> SampleDelta:
    return SampleDelta(x.index, list(x.token_ids), x.text, None if x.logprobs is None else list(x.logprobs),
                       x.finish_reason, x.stop_reason)

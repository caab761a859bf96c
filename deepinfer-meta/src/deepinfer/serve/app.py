"""The HTTP routes of ``deepinfer serve`` (FastAPI) over one EngineThread, data-parallel replicas or
the engine-core client: ``build_app``, and how a generation request is answered (``_respond``:
one JSON body, a coalesced event stream, or the common stream the engine client writes).

What the routes share is ``serving_state.py``; a request's engine requests ``engine_run.py``; the
event stream and the disconnect watch ``event_stream.py``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepinfer.runtime.beam_search import BeamSearchParams
from deepinfer.runtime.engine.detokenizer import stop_automaton
from deepinfer.runtime.loading.text_tokenizer import check_chat_template
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.access_log import AccessLogMiddleware, AccessRecord
from deepinfer.serve.beam_search import BeamSearchRun
from deepinfer.serve.client import EngineClient
from deepinfer.serve.engine_run import EngineRun
from deepinfer.serve.engine_thread import first_sample
from deepinfer.serve.event_stream import ClientGone, EventStream, event_stream, unless_disconnected
from deepinfer.serve.guard import HostPolicy, RequestGuard
from deepinfer.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    beam_search_params,
    chat_messages,
    chat_template_kwargs,
    check_conversation,
    check_stop,
    check_text,
    client_request_id,
    completion_prompts,
    loads_json,
    parse_body,
    sampling_params,
)
from deepinfer.serve.responses import ResponseBuilder, TokenStrings
from deepinfer.serve.responses import sse_events as _sse
from deepinfer.serve.serving_state import INLINE_INPUT, ServeConfig, ServingState
from deepinfer.serve.structured import check_grammar, grammar_compiler, structured_params
from deepinfer.serve.token_stream import TokenStream
from deepinfer.serve.tools import chat_tool_messages, tool_choice

__all__ = ["ServeConfig", "build_app"]

log = logging.getLogger("deepinfer.serve")


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
        # (its headers kept: a 405 names the methods the path takes in Allow)
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)

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
            raw = loads_json(body)
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
            kwargs = chat_template_kwargs(req)
            template = _chat_template(state, req)
            ids = await state.off_loop(_chat_size(messages, kwargs, template), _chat_ids, state, messages,
                                       req.add_generation_prompt, kwargs, template)
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
    async def completions(request: Request) -> Response:  # POST (registered below)
        req: CompletionRequest = await body_of(request, CompletionRequest)
        name = state.model_name(req.model)
        check_stop(req.stop, config.max_stop_strings)
        embeds = None
        if req.prompt_embeds is not None:  # vLLM's: prompts as embeddings
            if req.truncate_prompt_tokens is not None:
                raise APIError(400, "truncate_prompt_tokens applies to token prompts, not prompt_embeds",
                               "truncate_prompt_tokens")
            embeds, prompts = await _embeds_prompts(state, req)
            raw = []
        else:
            raw = completion_prompts(req.prompt)
            prompts = await state.off_loop(sum(len(p) for p in raw), lambda: [
                state.prompt_ids(p, "prompt", req.add_special_tokens) for p in raw])
            keep = state.truncation(req.truncate_prompt_tokens)
            if keep is not None:  # the last tokens (echo: their text)
                prompts = [p[-keep:] for p in prompts]
                raw = list(prompts)
        echo_lp = req.logprobs if req.echo else None  # the prompt's logprobs come first
        echo_only = req.echo and req.max_tokens == 0  # OpenAI's: the prompt (and its logprobs) alone
        params = [state.checked(sampling_params(
            req, state.max_tokens(len(p), 1 if echo_only else req.max_tokens, 16, "prompt", "max_tokens"),
            req.logprobs, {}, prompt_logprobs=echo_lp)) for p in prompts]
        await _structured_outputs(state, req, params, None)
        await _build_stop_automaton(state, params[0])
        echo = None
        if req.echo:  # the prompt as given; token ids decoded
            echo = await state.off_loop(sum(len(p) for p in raw), lambda: [
                p if isinstance(p, str) else str(state.tokenizer.decode(p)) for p in raw])
        response_id, engine_id = _response_ids("cmpl-", request, req)
        builder = ResponseBuilder("completion", response_id, name, req.n,
                                  [len(p) for p in prompts], _strings(state, req), req.logprobs,
                                  echo=echo, prompt_ids=prompts if echo is not None else None)
        builder.engine_id = engine_id
        builder.echo_only = echo_only
        if req.return_token_ids:  # (prompts given as embeddings have no ids: null)
            builder.token_ids_of = [p if embeds is None else None for p in prompts]
        return await _respond(request, state, builder, prompts, params, req, embeds,
                              beam_search_params(req, params[0]))

    async def chat_completions(request: Request) -> Response:  # POST (registered below)
        req: ChatCompletionRequest = await body_of(request, ChatCompletionRequest)
        name = state.model_name(req.model)
        check_stop(req.stop, config.max_stop_strings)
        template = _chat_template(state, req)
        tools = tool_choice(req, template or getattr(state.tokenizer, "chat_template", None), config.tool_call_parser)
        messages = chat_messages(chat_tool_messages(req.messages))
        check_conversation(messages)
        kwargs = chat_template_kwargs(req)
        if tools is not None:
            kwargs["tools"] = tools.template_tools
        prompt = await state.off_loop(_chat_size(messages, kwargs, template), _chat_ids, state, messages,
                                      req.add_generation_prompt, kwargs, template)
        keep = state.truncation(req.truncate_prompt_tokens)
        if keep is not None:
            prompt = prompt[-keep:]
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
        response_id, engine_id = _response_ids("chatcmpl-", request, req)
        builder = ResponseBuilder("chat", response_id, name, req.n, [len(prompt)], _strings(state, req), top)
        builder.engine_id = engine_id
        builder.tools = tools
        builder.token_ids_of = [prompt] if req.return_token_ids else None
        if req.echo:  # vLLM's: the last message's content first, when the reply continues its role
            if tools is not None:
                raise APIError(400, "echo does not run with tools (a tool call cannot continue a message)", "echo")
            last = messages[-1]
            builder.echo = [str(last.get("content") or "") if last.get("role") == "assistant" else ""]
        return await _respond(request, state, builder, [prompt], [params], req,
                              beam=beam_search_params(req, params))

    # The generation routes are plain Starlette routes: FastAPI's own (dependency solving, the
    # endpoint's wrapper) cost ~40 us of a request's ~220 us of admission on a 2-core VM
    # (bench/serve_frontend_cpu.py's harness), and these endpoints take nothing but the Request.
    # The middlewares and exception handlers above apply to them as to every route.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    # ... and matched first: a request tries the routes in order (~1.5 us each route it passes),
    # and no other route has their paths, so the order changes nothing else (a stable sort)
    app.router.routes.sort(key=lambda r: getattr(r, "path", None) not in _GENERATION_PATHS)
    return app


_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _response_ids(prefix: str, request: Request, req: Any) -> tuple[str, str]:
    """(the response's id, the base of the engine's request ids): ``prefix`` and the client's
    request id (the X-Request-Id header or vLLM's ``request_id``), else a new one. The engine's
    ids are always new: two clients may send the same id, and the engine must never mix their
    requests."""
    own = prefix + uuid.uuid4().hex
    given = client_request_id(request.headers.get("x-request-id"), req.request_id)
    return (own if given is None else prefix + given), own


def _chat_size(messages: list[dict[str, str]], kwargs: dict[str, Any], template: str | None = None) -> int:
    """The characters a chat template renders, and the template's own when the request gave one
    (what decides whether it runs off the loop)."""
    docs = kwargs.get("documents")
    size = sum(len(v) for d in docs if isinstance(d, dict) for v in d.values() if isinstance(v, str)
               ) if isinstance(docs, list) else 0  # (chat_template_kwargs' documents are not checked)
    return size + len(template or "") + sum(len(m["content"]) + len(m["role"]) for m in messages)


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


def _chat_template(state: ServingState, req: Any) -> str | None:
    """The template of a chat or tokenize request: its own ``chat_template`` (vLLM's; a 400 unless
    the server trusts requests with one), else ``--chat-template``'s, else None (the model's)."""
    given = req.chat_template
    if given is None:
        return state.config.chat_template
    if not state.config.trust_request_chat_template:
        raise APIError(400, "chat_template: this server does not take a request's own chat template (a template "
                            "is code the server runs); its operator can allow it with "
                            "--trust-request-chat-template", "chat_template")
    if not check_text(given, "chat_template").strip():
        raise APIError(400, "chat_template must not be empty", "chat_template")
    return str(given)


def _chat_ids(state: ServingState, messages: list[dict[str, str]], add_generation_prompt: bool,
              kwargs: dict[str, Any], template: str | None = None) -> list[int]:
    """The conversation's prompt ids; ``kwargs``: the template's extra arguments (tools included);
    ``template``: the template to use instead of the model's."""
    if template is not None and template is not state.config.chat_template:  # (a request's own: check it)
        try:
            check_chat_template(template, "chat_template")
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template") from None
    try:
        ids = state.llm.apply_chat_template(messages, add_generation_prompt, kwargs or None,
                                            template)["prompt_token_ids"]
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
                   params: list[SamplingParams], req: Any, embeds: list[Any] | None = None,
                   beam: BeamSearchParams | None = None) -> Response:
    record: AccessRecord = request.state.access
    record.request_id = builder.id
    record.prompt_tokens = builder.prompt_tokens
    deltas: EngineRun | BeamSearchRun
    if beam is None:
        deltas = state.start(builder.engine_id, prompts, params, embeds, req.priority, req.cache_salt)
    else:  # vLLM's use_beam_search: rounds of one-token requests (serve/beam_search.py)
        deltas = state.beam_search(builder.engine_id, prompts, beam, req.priority, req.cache_salt,
                                   params[0].skip_special_tokens)
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

        return JSONResponse(await unless_disconnected(request, collect()))

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    builder.continuous_usage = include_usage and req.stream_options.continuous_usage_stats

    interval = state.config.stream_interval
    if (isinstance(engine, EngineClient) and isinstance(deltas, EngineRun) and len(prompts) == 1
            and builder.n == 1 and builder.top is None and builder.echo is None and builder.tools is None and builder.token_ids_of is None
            and not builder.continuous_usage):  # the common stream (token_stream.py): one template a chunk
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

    return EventStream(event_stream(request, chunks(), record, close))



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

    return EventStream(event_stream(request, chunks(), record, close), on_start=stream.use_connection)

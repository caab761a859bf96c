"""What every route of a ``deepinfer serve`` front end shares: its configuration (``ServeConfig``,
the CLI flags of the same names) and ``ServingState``: the model's limits, the engine (an engine
thread, data-parallel replicas, or the engine-core client), metrics, the admission count and the
checks a request passes before it reaches the engine."""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from deepinfer.runtime.beam_search import BeamSearchParams
from deepinfer.runtime.sampling_params import SamplingParams, bad_words_token_ids
from deepinfer.serve.beam_search import BeamSearchRun
from deepinfer.serve.client import EngineClient
from deepinfer.serve.engine_run import EngineRun
from deepinfer.serve.engine_thread import EngineThread, arrival_gap_seconds, check_priority
from deepinfer.serve.metrics import MetricFamilies, ServerMetrics, cache_info
from deepinfer.serve.protocol import APIError, check_text
from deepinfer.serve.responses import TokenStrings
from deepinfer.serve.tools import TOOL_CALL_PARSERS

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# Request input (prompt characters, token ids) up to this size is tokenized on the event loop;
# more goes to the input threads (a thread hop costs more than tokenizing a short prompt).
INLINE_INPUT = 4096
#: vLLM's bad_words a request may give: each is matched against every step's tokens of its request
MAX_BAD_WORDS = 256
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
    # chat_template: the template chat requests use instead of the model's (--chat-template's text);
    # trust_request_chat_template: a request's chat_template may replace it (else a 400)
    chat_template: str | None = None
    trust_request_chat_template: bool = False

    def check(self, spell: Callable[[str], str] = str) -> None:
        """A ValueError for a value the server cannot run with, naming the field as ``spell``
        spells it (the CLI checks its flags with it before loading a model: ``--max-queue``)."""
        if not self.served_model_names:
            raise ValueError(f"{spell('served_model_names')} must name at least one model")
        if self.api_key == "":
            raise ValueError(f"{spell('api_key')} must not be empty (no key: leave it out)")
        for name, lo in (("max_queue", 0), ("max_request_bytes", 1), ("max_stop_strings", 0), ("stream_interval", 1)):
            number = getattr(self, name)
            if isinstance(number, bool) or not isinstance(number, int):
                raise ValueError(f"{spell(name)} must be an int >= {lo}, got {number!r}")
            if number < lo:
                raise ValueError(f"{spell(name)} must be >= {lo}, got {number}")
        if self.arrival_gap_ms is not None and not self.arrival_gap_ms >= 0:
            raise ValueError(f"{spell('arrival_gap_ms')} must be >= 0, got {self.arrival_gap_ms}")
        if self.chat_template is not None:
            from deepinfer.runtime.loading.text_tokenizer import check_chat_template

            if not isinstance(self.chat_template, str) or not self.chat_template.strip():
                raise ValueError(f"{spell('chat_template')} must be a non-empty template, got {self.chat_template!r:.40}")
            check_chat_template(self.chat_template, spell("chat_template"))
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"{spell('tool_call_parser')} must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")


class ServingState:
    """The model, the engine (one engine thread, or data-parallel replicas), metrics and the
    admission count, shared by every route.

    ``llm`` is an ``LLM`` (served in this process by an EngineThread) or a ``ReplicaSet`` (the
    replicas' processes serve; it has the tokenizer and limits the routes need)."""

    def __init__(self, llm: Any, config: ServeConfig) -> None:
        config.check()
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
            self.eos_token_ids: list[int] | None = llm.info.get("eos_token_ids")  # (beam search)
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
            self.eos_token_ids = llm.info.get("eos_token_ids")
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
            eos = getattr(llm, "eos_token_ids", None)
            self.eos_token_ids = None if eos is None else sorted(eos)
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

    def prompt_ids(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(check_text(prompt, param), add_special_tokens=add_special_tokens).input_ids)
        else:
            if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):  # (C loops: the common case)
                bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
                raise APIError(400, f"token id {bad} is outside the vocabulary (size {self.vocab_size})", param)
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt has no tokens", param)
        return ids

    def truncation(self, k: int | None) -> int | None:
        """vLLM's ``truncate_prompt_tokens``: how many of a prompt's last tokens to keep (None: all);
        -1 means ``max_model_len``; a 400 for 0, other negatives or more than ``max_model_len``."""
        if k is None:
            return None
        if k == -1:
            return self.max_model_len
        if k < 1 or k > self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, {self.max_model_len}], "
                                f"got {k}", "truncate_prompt_tokens")
        return k

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
            param = next((p for p in ("logit_bias", "allowed_token_ids") if p in str(exc)), "stop_token_ids")
            raise APIError(400, str(exc).replace("SamplingParams.", ""), param) from None
        if params.bad_words:  # tokenized here as the engine will (a word without tokens: a 400, not a failure there)
            if len(params.bad_words) > MAX_BAD_WORDS:
                raise APIError(400, f"bad_words has {len(params.bad_words)} words; at most {MAX_BAD_WORDS}",
                               "bad_words")
            try:
                bad_words_token_ids(params.bad_words, self.tokenizer)
            except ValueError as exc:
                raise APIError(400, str(exc).replace("SamplingParams.", ""), "bad_words") from None
        return params

    def start(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
              embeds: list[Any] | None = None, priority: int = 0, cache_salt: str | None = None) -> EngineRun:
        """Admit (503 when full or the engine is down) and submit one engine request per prompt
        (``embeds``: the prompts' embeddings, whose ids are placeholders; ``priority``: the
        scheduler's, smaller first; ``cache_salt``: their prefix-cache salt)."""
        self.check_extras(priority, cache_salt)
        self.admit(len(prompts))
        return EngineRun(self, request_id, prompts, params, embeds, priority, cache_salt)

    def check_extras(self, priority: int, cache_salt: str | None) -> None:
        """A 400 for a ``priority`` or ``cache_salt`` the engine cannot take."""
        if priority:
            if not -2**31 <= priority < 2**31:
                raise APIError(400, f"priority must be a 32-bit int, got {priority}", "priority")
            try:  # (a policy not known here, as behind replicas: the engine thread checks)
                check_priority(priority, getattr(getattr(self.llm, "engine_args", None), "scheduling_policy", None))
            except ValueError as exc:
                raise APIError(400, str(exc), "priority") from None
        if cache_salt is not None and not check_text(cache_salt, "cache_salt"):
            raise APIError(400, "cache_salt must be a non-empty string if given", "cache_salt")

    def beam_search(self, request_id: str, prompts: list[list[int]], params: BeamSearchParams, priority: int,
                    cache_salt: str | None, skip_special_tokens: bool) -> BeamSearchRun:
        """vLLM's ``use_beam_search``: a search whose rounds are submitted as ``start`` submits
        (each round admitted, with the request's priority and cache salt)."""
        if self.eos_token_ids is None:
            raise APIError(400, "beam search needs the engine's end-of-sequence ids, which this engine core does "
                                "not report (an older version): restart the server", "use_beam_search")
        self.check_extras(priority, cache_salt)  # (now: a 400 before a stream starts)

        def decode(ids: list[int]) -> str:
            return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

        return BeamSearchRun(lambda rid, ps, sps: self.start(rid, ps, sps, None, priority, cache_salt), request_id,
                             prompts, params, self.eos_token_ids, self.max_model_len, decode)

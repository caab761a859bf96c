"""The runtime's model over its paged KV cache equals transformers on the same GGUF (greedy, fp32).

Driven by the test-only reference driver, so a mismatch here is the model's or the attention's,
not the scheduler's (the LLM-level tests cover the engine-driven loop).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.runtime.worker.model_runner import ModelRunner
from reference_driver import greedy_generate

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
     198, 1, 4093, 198, 6121, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [19556, 28, 957, 1462, 314],
    [504, 3458, 282, 4649, 314],
    [42],
]


@pytest.fixture(scope="module")
def runner(loaded_default):
    return ModelRunner(loaded_default, num_blocks=64, block_size=4, device=torch.device("cpu"),
                       dtype=torch.float32)


@pytest.mark.parametrize("chunk", [1 << 30, 3])
def test_batched_greedy_equals_transformers(runner, hf_greedy, chunk):
    ours = greedy_generate(runner, PROMPTS, 8, chunk=chunk)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        assert got == hf_greedy(prompt, 8), f"prompt of {len(prompt)} tokens, chunk {chunk}"


def test_logits_match_transformers(runner, hf_default):
    import numpy as np

    prompt = PROMPTS[0]
    logits = runner.execute(
        input_ids=np.array(prompt), positions=np.arange(len(prompt)),
        slot_mapping=np.arange(len(prompt)) + 4 * 20, query_start_loc=np.array([0, len(prompt)]),
        seq_lens=np.array([len(prompt)]), block_tables=np.arange(20, 40, dtype=np.int32)[None],
        logits_indices=np.arange(len(prompt)))
    with torch.no_grad():
        ref = hf_default(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)

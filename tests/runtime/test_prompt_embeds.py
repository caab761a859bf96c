"""Prompts given as embeddings (issue 26): ``llm.generate({"prompt_embeds": tensor[L, hidden]})``,
as vLLM's (tests/v1/entrypoints/llm/..., examples/offline_inference/prompt_embed_inference.py).

The expectation is the same prompt given as token ids: ``embed_tokens(ids)`` as embeddings must
give the token prompt's greedy output, alone, in a batch mixed with token prompts, chunked over
steps, recomputed after preemption, and with prefix caching on (two different embeddings prompts
of one length must not share cached blocks; the same one again does).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import save_tiny_model, save_tiny_tokenizer

VOCAB = 320
IDS_A = [5, 9, 17, 33, 4, 100, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
IDS_B = [50, 61, 7, 3, 44, 101, 210, 77, 81, 92, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-embeds")
    model = save_tiny_model(path, "llama", seed=1, vocab=VOCAB)
    save_tiny_tokenizer(path, vocab=VOCAB)
    return str(path), model


def _llm(path: str, **kw):
    from deepinfer import LLM

    opts = dict(dtype="float32", max_model_len=128, cpu_kv_cache_bytes=8 << 20, num_threads=1, block_size=16,
                enable_prompt_embeds=True)
    opts.update(kw)
    return LLM(path, **opts)


def _embeds(model, ids):
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids)).detach()


def _greedy(n=8):
    from deepinfer import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_embeds_prompt_equals_token_prompt_and_reports_placeholders(tiny):
    path, model = tiny
    llm = _llm(path, enable_prefix_caching=False)
    want = llm.generate(IDS_A, _greedy(), use_tqdm=False)[0]
    got = llm.generate({"prompt_embeds": _embeds(model, IDS_A)}, _greedy(), use_tqdm=False)[0]
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    # no prompt text gives the output context: its text is its ids decoded alone (as vLLM's)
    assert got.outputs[0].text == llm.text_tokenizer.decode(list(want.outputs[0].token_ids))
    assert got.prompt is None and got.prompt_token_ids == [0] * len(IDS_A)  # vLLM's placeholders
    batched = llm.generate({"prompt_embeds": _embeds(model, IDS_A)[None]}, _greedy(), use_tqdm=False)[0]
    assert list(batched.outputs[0].token_ids) == list(want.outputs[0].token_ids)  # [1, L, H] taken as [L, H]


def test_mixed_batch_chunked_prefill(tiny):
    path, model = tiny
    llm = _llm(path, max_num_batched_tokens=24, max_num_seqs=4)  # 20-token prompts span steps
    token_prompts = [IDS_A, IDS_B[:9], IDS_B, IDS_A[:5]]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(token_prompts, _greedy(), use_tqdm=False)]
    mixed = [{"prompt_embeds": _embeds(model, IDS_A)}, IDS_B[:9], {"prompt_embeds": _embeds(model, IDS_B)},
             {"prompt_embeds": _embeds(model, IDS_A[:5])}]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(mixed, _greedy(), use_tqdm=False)]
    assert got == want


def test_prefix_caching_never_mixes_different_embeddings(tiny):
    path, model = tiny
    llm = _llm(path, enable_prefix_caching=True)
    want_b = list(llm.generate(IDS_B, _greedy(), use_tqdm=False)[0].outputs[0].token_ids)
    want_a = list(llm.generate(IDS_A, _greedy(), use_tqdm=False)[0].outputs[0].token_ids)
    assert want_a != want_b
    a = llm.generate({"prompt_embeds": _embeds(model, IDS_A)}, _greedy(), use_tqdm=False)[0]
    b = llm.generate({"prompt_embeds": _embeds(model, IDS_B)}, _greedy(), use_tqdm=False)[0]  # same length
    assert list(a.outputs[0].token_ids) == want_a
    assert list(b.outputs[0].token_ids) == want_b
    assert b.metrics["num_cached_tokens"] == 0  # nothing of A's blocks
    again = llm.generate({"prompt_embeds": _embeds(model, IDS_A)}, _greedy(), use_tqdm=False)[0]
    assert again.metrics["num_cached_tokens"] == 16  # the same embeddings do share a full block
    assert list(again.outputs[0].token_ids) == want_a


def test_recompute_after_preemption(tiny):
    path, model = tiny
    # 4 sequences of up to 44 tokens (3 blocks each) in 6 blocks: some are preempted and recomputed
    llm = _llm(path, num_kv_blocks=6, max_model_len=64, max_num_seqs=4, enable_prefix_caching=False)
    prompts = [IDS_A, IDS_B, IDS_A[3:], IDS_B[2:]]
    want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy(24), use_tqdm=False)]
    before = llm.engine.stats()["num_preemptions_total"]
    got = llm.generate([{"prompt_embeds": _embeds(model, p)} for p in prompts], _greedy(24), use_tqdm=False)
    assert llm.engine.stats()["num_preemptions_total"] > before
    assert [list(o.outputs[0].token_ids) for o in got] == want


def test_default_model_embeds_equal_ids(default_gguf):
    from deepinfer import LLM

    llm = LLM(default_gguf, enable_prompt_embeds=True, max_model_len=64, enable_prefix_caching=False)
    ids = llm.text_tokenizer("The capital of France is").input_ids
    with torch.no_grad():
        emb = llm.runner.model.embed_tokens(torch.tensor(ids)).float()
    want = llm.generate(ids, _greedy(6), use_tqdm=False)[0]
    got = llm.generate({"prompt_embeds": emb}, _greedy(6), use_tqdm=False)[0]
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)


def test_bad_embeddings_prompts_are_clear_errors(tiny):
    from deepinfer import SamplingParams

    path, model = tiny
    llm = _llm(path)
    good = _embeds(model, IDS_A[:4])
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_embeds must have shape \(L, 64\).*got \(4, 32\)"):
        llm.generate([{"prompt_embeds": good}, {"prompt_embeds": torch.zeros(4, 32)}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"got \(2, 4, 64\)"):
        llm.generate({"prompt_embeds": torch.zeros(2, 4, 64)}, use_tqdm=False)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        llm.generate({"prompt_embeds": good.tolist()}, use_tqdm=False)
    with pytest.raises(ValueError, match="non-finite"):
        llm.generate({"prompt_embeds": torch.full((3, 64), float("nan"))}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_embeds": torch.zeros(0, 64)}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate({"prompt_embeds": torch.zeros(128, 64)}, use_tqdm=False)
    with pytest.raises(ValueError, match="not both"):
        llm.generate({"prompt_embeds": good, "prompt_token_ids": IDS_A[:4]}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: SamplingParams.prompt_logprobs"):
        llm.generate({"prompt_embeds": good}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate({"prompt_embeds": good}, SamplingParams(repetition_penalty=1.2), use_tqdm=False)
    with pytest.raises(ValueError, match="generate"):
        llm.stream({"prompt_embeds": good})
    assert not llm.engine.has_unfinished()  # nothing was queued by the refused calls
    out = llm.generate({"prompt_embeds": good}, _greedy(2), use_tqdm=False)[0]  # still usable
    assert len(out.outputs[0].token_ids) == 2


def test_prompt_embeds_need_the_option(tiny):
    from deepinfer.runtime.engine_args import EngineArgs

    path, model = tiny
    llm = _llm(path, enable_prompt_embeds=False)
    with pytest.raises(ValueError, match=r"enable_prompt_embeds=True"):
        llm.generate({"prompt_embeds": _embeds(model, IDS_A[:4])}, use_tqdm=False)
    assert EngineArgs().enable_prompt_embeds is False  # vLLM's default
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineArgs(enable_prompt_embeds=True, tensor_parallel_size=2)


def test_overlap_scheduling(tiny):
    """Decode steps of embeddings prompts run ahead like any (ZOS, forced here on CPU)."""
    path, model = tiny
    llm = _llm(path, overlap_scheduling=True, enable_prefix_caching=False)
    want = [list(o.outputs[0].token_ids) for o in llm.generate([IDS_A, IDS_B], _greedy(12), use_tqdm=False)]
    got = llm.generate([{"prompt_embeds": _embeds(model, IDS_A)}, {"prompt_embeds": _embeds(model, IDS_B)}],
                       _greedy(12), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert llm.engine.overlap is not None and llm.engine.overlap.num_ahead > 0

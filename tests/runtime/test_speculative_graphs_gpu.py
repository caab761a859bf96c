"""Speculative verify steps replayed from CUDA graphs (``worker.verify_graph_runner``) give the
eager path's greedy tokens (float32, TF32 off): n-gram drafts on a tiny random model, batch
growing across graph paddings, against plain eager decoding; and the draft model's forwards under
its own graphs keep every draft when the target drafts for itself. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")

K = 3


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    from gpu_shapes import write_shape_dir

    return write_shape_dir(str(tmp_path_factory.mktemp("shape")), "test-small")


def _llm(shape_dir, **kw):
    from deepinfer import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    llm = LLM(shape_dir, device="cuda", dtype="float32", dummy_weights=True, max_model_len=512, num_kv_blocks=256,
              max_num_seqs=16, max_num_batched_tokens=128, **kw)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # livelier than the dummy init: distinct greedy tokens
        for p in llm.runner.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return llm


def _prompts():
    rng = np.random.default_rng(0)
    # repeated patterns, so that n-gram lookup drafts and some drafts are kept
    return [(rng.integers(3, 1000, int(rng.integers(3, 8))).tolist() * 8)[:40] for _ in range(11)]


def _run(llm):
    from deepinfer import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("prefetch", ["0", "1"])
def test_verify_graphs_give_the_eager_greedy_tokens(shape_dir, monkeypatch, prefetch):
    # DEEPINFER_PDL_PREFETCH=1 (read at capture): the decode attention of a verify row reads the
    # step's k + 1 new keys and values only after its PDL wait (CudaGraphRunner's new_rows)
    monkeypatch.setenv("DEEPINFER_PDL_PREFETCH", prefetch)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    eager = _run(_llm(shape_dir, enforce_eager=True))
    llm = _llm(shape_dir, speculative_config=spec)
    vg = llm.runner.verify_graphs
    assert vg is not None and vg.sizes == [b * (K + 1) for b in llm.runner.graphs.batch_sizes]
    got = _run(llm)
    st = llm.engine.speculator.stats
    assert vg.num_replays > 10 and st.num_accepted_tokens > 0, (vg.num_replays, st.as_dict())
    assert sum(a == b for a, b in zip(got, eager, strict=True)) == len(eager)


def test_oracle_mode_keeps_every_draft_under_graphs(shape_dir):
    llm = _llm(shape_dir, speculative_config={"method": "oracle", "num_speculative_tokens": K})
    prompts = _prompts()[:4]
    rec = [list(range(500 + 9 * i, 540 + 9 * i)) for i in range(len(prompts))]
    for p, r in zip(prompts, rec, strict=True):
        llm.engine.speculator.record_oracle(p, r)
    from deepinfer import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=21, ignore_eos=True), use_tqdm=False)
    assert llm.engine.speculator.stats.acceptance_rate == 1.0
    for o, r in zip(outs, rec, strict=True):
        toks = list(o.outputs[0].token_ids)
        drafted = [j for j in range(1, 21) if j % (K + 1) != 0]
        assert [toks[j] for j in drafted] == [r[j] for j in drafted]
    assert llm.runner.verify_graphs.num_replays > 0


def test_draft_model_forwards_under_graphs(shape_dir):
    """The target as its own draft (its weights copied into the draft runner): the draft's
    catch-up and one-token forwards replay the draft runner's graphs and nearly every draft is
    kept (fp32: only near-ties between differently padded rows could flip); output = eager plain."""
    eager = _run(_llm(shape_dir, enforce_eager=True))
    llm = _llm(shape_dir, speculative_config={"method": "draft_model", "model": shape_dir, "num_speculative_tokens": K})
    draft = llm.engine.speculator.draft
    with torch.no_grad():
        for d, t in zip(draft.runner.model.parameters(), llm.runner.model.parameters(), strict=True):
            d.copy_(t)
    vg = draft.runner.verify_graphs
    assert vg is not None
    got = _run(llm)
    st = llm.engine.speculator.stats
    assert vg.num_replays >= draft.num_forwards // 2 and st.acceptance_rate > 0.95, (vg.num_replays, st.as_dict())
    assert got == eager


def test_plain_steps_run_ahead_under_graphs_while_speculating(shape_dir):
    """The overlap loop (on by default with graphs) launches a speculating loop's plain decode
    steps (n-gram lookups that miss on prompts without repeats) ahead of the step before, over
    the decode graphs, and still verifies drafts where lookups hit: output = eager plain."""
    from deepinfer import SamplingParams

    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.permutation(np.arange(3, 1000))[:40].tolist()} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    eager = [list(o.outputs[0].token_ids) for o in _llm(shape_dir, enforce_eager=True).generate(
        prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = _llm(shape_dir, speculative_config=spec)
    assert llm.engine.overlap is not None
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager
    assert llm.engine.overlap.num_ahead > 0

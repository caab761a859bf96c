"""Overlap scheduling (ZOS) on the GPU: greedy tokens identical with ZOS on and off, with CUDA
graphs and eagerly (float32, TF32 off), while the batch grows and shrinks across graph paddings
(arrivals, different lengths, aborts mid-decode). Skipped without a CUDA device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    from gpu_shapes import write_shape_dir

    return write_shape_dir(str(tmp_path_factory.mktemp("shape")), "test-small")


def test_zos_on_and_off_with_and_without_graphs_give_the_same_greedy_tokens(shape_dir):
    from test_cuda_graphs_gpu import _llm, _scenario

    results, ahead = {}, {}
    for eager in (True, False):
        for overlap in (False, True):
            llm = _llm(shape_dir, enforce_eager=eager, overlap_scheduling=overlap)
            assert (llm.engine.overlap is not None) == overlap
            results[eager, overlap], _ = _scenario(llm)
            ahead[eager, overlap] = 0 if llm.engine.overlap is None else llm.engine.overlap.num_ahead
            assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cfg.num_blocks
            del llm
    reference = results[True, False]
    # The scenario aborts these after a fixed number of steps: with ZOS a request that arrives while
    # a step runs ahead is admitted one step later (as in vLLM's async scheduling), so an abort by
    # step count leaves it one token fewer. Its tokens are then a prefix of the reference's.
    aborted = {"s2-3", "s5-0"}
    same = {k: sum(v[r] == reference[r] for r in reference if r not in aborted) for k, v in results.items()}
    print(f"requests identical to eager without ZOS (of {len(reference) - len(aborted)}): {same}; "
          f"steps run ahead: {ahead}")
    assert all(n == len(reference) - len(aborted) for n in same.values())
    for v in results.values():
        for r in aborted:
            a, b = v[r], reference[r]
            assert a[:len(b)] == b[:len(a)], r
    assert ahead[False, True] > 20 and ahead[True, True] > 20


def test_zos_with_penalties_and_seeded_sampling_matches_synchronous(shape_dir):
    # Penalized rows of a step launched ahead count the previous step's token on the device.
    from deepinfer import SamplingParams
    from test_cuda_graphs_gpu import _llm

    prompts = [[5, 6, 7] * 4, [9, 9, 9, 9], [11, 12], [40, 41, 42, 43, 44]]
    params = [SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=1.5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=2.0, repetition_penalty=1.5,
                             ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)]
    got = {}
    for overlap in (False, True):
        llm = _llm(shape_dir, overlap_scheduling=overlap)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[overlap] = [list(o.outputs[0].token_ids) for o in outs]
        if overlap:
            assert llm.engine.overlap.num_ahead > 20
        del llm
    assert got[True] == got[False]

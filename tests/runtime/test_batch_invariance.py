"""Batch invariance on CPU (issue 29, item 11): a row's result does not depend on the other rows
of its step.

- The native kernels: each output row of ``_cpu_kernels.linear`` is bitwise the same computed
  alone and among 2..40 rows, for every weight type, instruction set and thread count (the
  AVX-512 float32 single-row GEMV used to sum in another order than its multi-row tile).
- ``deterministic=True`` runs every step natively (prompt chunks one row per token): a prompt's
  logits are bitwise the same prefilled alone, batched with other prompts and decode rows, or
  split into chunks; 64 greedy requests give the same tokens sent together as alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.model_loader import load_model
from deepinfer.runtime.worker.model_runner import ModelRunner
from tiny_models import save_tiny_model

ck = pytest.importorskip("deepinfer_engine._cpu_kernels", reason="engine built without _cpu_kernels")
gguf = pytest.importorskip("gguf", reason="gguf (quantizer) is not installed")
CPU = torch.device("cpu")
BS = 4


@pytest.mark.parametrize("kind", ["F32", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_rows_are_bitwise_independent_of_the_batch(kind, threads):
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    n, k = 67, 1536 + 32  # odd block count and a partial row tile
    w = rng.standard_normal((n, k)).astype(np.float32)
    spec = ("F32", w) if kind == "F32" else (kind, quantize(w, getattr(gguf.GGMLQuantizationType, kind)))
    x = rng.standard_normal((40, k)).astype(np.float32)
    for isa in ck.available_isas():
        alone = np.concatenate([ck.linear(spec, x[i:i + 1], num_threads=threads, isa=isa) for i in range(40)])
        for rows in (2, 3, 4, 5, 7, 16, 17, 40):
            for start in (0, 40 - rows):
                y = ck.linear(spec, x[start:start + rows], num_threads=threads, isa=isa)
                assert np.array_equal(y, alone[start:start + rows]), (isa, rows, start)


def _runner(path, deterministic=True) -> ModelRunner:
    loaded = load_model(str(path), device=CPU, dtype=torch.float32, max_positions=128)
    return ModelRunner(loaded, num_blocks=64, block_size=BS, device=CPU, dtype=torch.float32,
                       deterministic=deterministic)


def _step(runner, chunks, tables):
    """One step over ``chunks``: (seq index, tokens, first position); logits of each chunk's last row."""
    ids, pos, qsl, lens = [], [], [0], []
    for _, toks, start in chunks:
        ids += toks
        pos += list(range(start, start + len(toks)))
        qsl.append(len(ids))
        lens.append(start + len(toks))
    pos_a = np.array(pos)
    seq_of = np.repeat([c[0] for c in chunks], np.diff(qsl))
    slots = tables[seq_of, pos_a // BS] * BS + pos_a % BS
    return runner.execute(input_ids=np.array(ids), positions=pos_a, slot_mapping=slots,
                          query_start_loc=np.array(qsl), seq_lens=np.array(lens),
                          block_tables=tables[[c[0] for c in chunks]], logits_indices=np.array(qsl[1:]) - 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_deterministic_steps_give_a_sequence_the_same_logits_in_any_batch(tmp_path, arch):
    save_tiny_model(tmp_path, arch)
    tables = np.array([[16 * i + j for j in range(16)] for i in range(4)], dtype=np.int32)
    prompt = [5, 9, 13, 100, 3, 200, 4, 11, 250, 7]
    others = [[7] * 9, [1, 2, 3], [42, 43, 44, 45, 46, 47]]
    # alone: the whole prompt in one step, then one decode step
    alone = _runner(tmp_path)
    a1 = _step(alone, [(0, prompt, 0)], tables)[0]
    tok = int(a1.argmax())
    a2 = _step(alone, [(0, [tok], len(prompt))], tables)[0]
    # batched: other prompts in the same prefill step (in front of it), then decoded with a new prompt
    batched = _runner(tmp_path)
    b1 = _step(batched, [(1, others[0], 0), (2, others[1], 0), (0, prompt, 0)], tables)[2]
    b2 = _step(batched, [(1, [3], 9), (3, others[2], 0), (0, [tok], len(prompt)), (2, [8], 3)], tables)[2]
    # chunked: the prompt over three steps of different sizes
    chunked = _runner(tmp_path)
    _step(chunked, [(0, prompt[:3], 0)], tables)
    _step(chunked, [(1, others[0], 0), (0, prompt[3:4], 3)], tables)
    c1 = _step(chunked, [(0, prompt[4:], 4)], tables)[0]
    c2 = _step(chunked, [(0, [tok], len(prompt)), (1, [2], 9)], tables)[0]
    assert torch.equal(a1, b1) and torch.equal(a1, c1)
    assert torch.equal(a2, b2) and torch.equal(a2, c2)


def test_deterministic_needs_the_native_kernels(tmp_path, monkeypatch):
    save_tiny_model(tmp_path, "llama")
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "0")
    with pytest.raises(ValueError, match="deterministic=True"):
        _runner(tmp_path)


def test_64_greedy_requests_together_equal_alone_on_the_default_model():
    from deepinfer import LLM, SamplingParams

    subjects = ["the ocean", "Python", "a cat", "the moon", "bread", "music", "winter", "a robot", "chess",
                "trains", "coffee", "mountains", "history", "rain", "a library", "the sun"]
    forms = ["Write one sentence about {}.", "Tell me a fact about {}:", "Q: What is {}?\nA:", "A short poem about {}:"]
    prompts = [forms[i % 4].format(subjects[i % 16]) + (" Be brief." if i >= 32 else "") for i in range(64)]
    llm = LLM(deterministic=True, max_num_batched_tokens=256)  # the 64 prompts take several prefill steps
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    differ = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert differ == [], f"{len(differ)} of 64 differ: {differ}"


def test_torchs_int4_kernel_rows_are_independent_of_the_batch():
    """The default path's int4 matmul (below ``DENSE_FROM_ROWS`` rows) gives a row bitwise the same
    alone and among others: what varies on the default path is which kernel a row meets (native
    decode vs torch in a mixed step, the bfloat16 GEMM from 128 rows), not this kernel."""
    from deepinfer.runtime.models.quantized import DENSE_FROM_ROWS, _int4_mm, pack_int4

    gen = torch.Generator().manual_seed(0)
    n, k = 192, 576
    packed = pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen))
    sz = torch.stack((torch.rand(k // 32, n, generator=gen), torch.randn(k // 32, n, generator=gen)),
                     -1).to(torch.bfloat16).contiguous()
    x = torch.randn(DENSE_FROM_ROWS - 1, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([_int4_mm(x[i:i + 1], packed, 32, sz) for i in range(len(x))])
    for rows in (2, 3, 5, 16, 33, 64, DENSE_FROM_ROWS - 1):
        assert torch.equal(_int4_mm(x[:rows], packed, 32, sz), alone[:rows]), rows


def test_seeded_requests_together_equal_alone_on_the_default_model():
    from deepinfer import LLM, SamplingParams

    subjects = ["the ocean", "Python", "a cat", "the moon", "bread", "music", "winter", "a robot"]
    prompts = [f"Write one sentence about {s}." for s in subjects] * 2
    llm = LLM(deterministic=True)
    sps = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1000 + i) for i in range(len(prompts))]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, sps, strict=True)]
    assert together == alone

"""The CPU prefill path: float32 linears through oneDNN (and their F.linear fallback), and the
chunked causal attention of long prefills, against independent float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from deepinfer.runtime.attention import torch_paged
from deepinfer.runtime.attention.metadata import build_attention_metadata
from deepinfer.runtime.models import cpu_linear as cl
from torch import nn


@pytest.fixture
def fresh_check(monkeypatch):
    """Re-run the once-per-process oneDNN check inside the test (and again after it)."""
    cl.onednn_unavailable_reason.cache_clear()
    yield monkeypatch
    cl.onednn_unavailable_reason.cache_clear()


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def _onednn_reason() -> str | None:
    cl.onednn_unavailable_reason.cache_clear()
    return cl.onednn_unavailable_reason()


@pytest.mark.parametrize("rows,k,n", [(4, 64, 48), (17, 576, 960), (130, 96, 200), (512, 576, 1728)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_major", [False, True])
def test_onednn_linear_matches_float64_reference(rows, k, n, bias, input_major, fresh_check):
    reason = _onednn_reason()
    if reason is not None:
        pytest.skip(f"oneDNN linear not usable in this torch: {reason}")
    calls = []
    real = cl._onednn_op()
    fresh_check.setattr(cl, "_onednn_op", lambda: lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    if input_major:  # the loader's [in, out] relayout: a transposed view of the parameter
        w = w.t().contiguous().t()
    b = torch.randn(n, generator=gen) if bias else None
    got = cl.cpu_linear(x, w, b)
    assert calls, "the oneDNN op was not used"
    ref = _reference(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # float32 rounding of a k-term dot product (the same bound F.linear meets)
    assert torch.allclose(got.double(), ref, rtol=0, atol=2e-6 * math.sqrt(k) * float(ref.abs().max()) + 1e-6)
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-5)


def test_few_rows_and_other_dtypes_stay_on_f_linear(fresh_check):
    calls = []
    fresh_check.setattr(cl, "_onednn_op", lambda: lambda *a: calls.append(1))
    w = torch.randn(32, 64)
    for x in (torch.randn(cl.ONEDNN_FROM_ROWS - 1, 64), torch.randn(3, 5, 64)):
        assert torch.equal(cl.cpu_linear(x, w), F.linear(x, w))
    xb, wb = torch.randn(8, 64, dtype=torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(cl.cpu_linear(xb, wb), F.linear(xb, wb))
    assert not calls


def test_switched_off_falls_back_to_f_linear(fresh_check):
    fresh_check.setenv(cl.ENV_SWITCH, "0")
    assert cl.ENV_SWITCH in (cl.onednn_unavailable_reason() or "")
    x, w, b = torch.randn(64, 96), torch.randn(40, 96), torch.randn(40)
    assert torch.equal(cl.cpu_linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("broken,words", [
    (lambda *a: (_ for _ in ()).throw(RuntimeError("no kernel")), "not usable (RuntimeError: no kernel)"),
    (lambda x, w, b, *a: F.linear(x, w, b) + 1.0, "disagrees with F.linear"),
])
def test_broken_private_op_falls_back_with_the_reason(broken, words, fresh_check, caplog):
    fresh_check.setattr(cl, "_onednn_op", lambda: broken)
    with caplog.at_level("INFO", logger=cl.__name__):
        reason = cl.onednn_unavailable_reason()
    assert reason is not None and words in reason
    assert words in caplog.text
    x, w = torch.randn(64, 96), torch.randn(40, 96)
    assert torch.equal(cl.cpu_linear(x, w), F.linear(x, w))


def test_cpu_linear_module_shares_the_parameters():
    for bias in (False, True):
        lin = nn.Linear(24, 40, bias=bias)
        new = cl.CpuLinear.sharing(lin)
        assert new.weight is lin.weight and new.bias is lin.bias
        assert dict(new.named_parameters()).keys() == dict(lin.named_parameters()).keys()
        x = torch.randn(9, 24)
        assert torch.allclose(new(x).double(), _reference(x, lin.weight.detach(), lin.bias), atol=1e-5)


def _hidden(model, ids: list[int]) -> torch.Tensor:
    from deepinfer.runtime.loading.model_loader import LoadedModel
    from deepinfer.runtime.worker.model_runner import ModelRunner

    runner = ModelRunner(LoadedModel(model=model, config=model.config, path=""), num_blocks=8, block_size=16,
                         device=torch.device("cpu"), dtype=torch.float32)
    n = len(ids)
    return runner.execute(input_ids=np.array(ids), positions=np.arange(n), slot_mapping=np.arange(n),
                          query_start_loc=np.array([0, n]), seq_lens=np.array([n]),
                          block_tables=np.arange(8, dtype=np.int32)[None], logits_indices=np.arange(n))


def test_loaded_cpu_model_runs_its_projections_on_cpu_linear(tiny_model_dir, fresh_check):
    """The loader swaps the float32 CPU projections for CpuLinear over the same parameters (the
    loaded weights, what weight_slots points at), and the logits of every row agree with F.linear's."""
    from deepinfer.runtime.loading.model_loader import load_model

    model = load_model(tiny_model_dir, device=torch.device("cpu"), dtype=torch.float32).model
    slots = model.weight_slots()
    for i, layer in enumerate(model.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert type(getattr(layer, name)) is cl.CpuLinear
        assert slots[f"model.layers.{i}.self_attn.q_proj.weight"][0] is layer.qkv_proj.weight
    ids = [(7 * i) % 300 + 3 for i in range(40)]
    on = _hidden(model, ids)
    fresh_check.setenv(cl.ENV_SWITCH, "0")
    cl.onednn_unavailable_reason.cache_clear()
    off = _hidden(model, ids)
    assert torch.allclose(on, off, rtol=1e-4, atol=1e-4)


def test_long_prompt_greedy_equals_transformers(loaded_default, hf_greedy, tokenizer):
    """A prompt of a few hundred tokens (oneDNN linears, several attention chunks) continues as
    transformers continues it."""
    from deepinfer.runtime.worker.model_runner import ModelRunner
    from reference_driver import greedy_generate

    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type, oil-based inks and a wooden press adapted from those used for "
            "wine and olive oil. ") * 6 + "In short, the printing press"
    prompt = tokenizer.encode(text)
    assert len(prompt) > 2 * torch_paged.CPU_QUERY_CHUNK
    runner = ModelRunner(loaded_default, num_blocks=64, block_size=16, device=torch.device("cpu"),
                         dtype=torch.float32)
    assert greedy_generate(runner, [prompt], 8)[0] == hf_greedy(prompt, 8)


# ---- attention --------------------------------------------------------------------------------
def _dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, past: int, scale: float) -> np.ndarray:
    """float64 causal GQA attention of q rows [L, H, D] sitting at positions past.. over k/v [S, KVH, D]."""
    rows, heads, _ = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape)
    for r in range(rows):
        n = past + r + 1
        for h in range(heads):
            s = (k[:n, h // group] @ q[r, h]) * scale
            p = np.exp(s - s.max())
            out[r, h] = (p / p.sum()) @ v[:n, h // group]
    return out


def test_chunked_prefill_attention_matches_dense_reference():
    """A mixed CPU step: a whole 150-token prompt and a 100-token continuation after 37 cached
    tokens (both past CPU_QUERY_CHUNK: several chunks, the last one partial), a short prompt and a
    decode row, against float64 attention computed from scratch."""
    torch.manual_seed(0)
    heads, kvh, d, bs = 6, 2, 16, 16
    nb = 40
    cache = torch.randn(2, nb + 1, bs, kvh, d)  # garbage in unwritten slots must not matter
    # (cached tokens, new tokens) per sequence
    seqs = [(0, 150), (37, 100), (0, 9), (20, 1)]
    assert seqs[0][1] > torch_paged.CPU_QUERY_CHUNK and seqs[0][1] % torch_paged.CPU_QUERY_CHUNK
    tables, start_block = [], 0
    full_k, full_v = [], []
    for past, new in seqs:
        blocks = (past + new + bs - 1) // bs
        tables.append(list(range(start_block, start_block + blocks)))
        start_block += blocks
        full_k.append(torch.randn(past + new, kvh, d))
        full_v.append(torch.randn(past + new, kvh, d))
    width = max(len(t) for t in tables)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)

    def slots(i: int, positions: range) -> list[int]:
        return [tables[i][p // bs] * bs + p % bs for p in positions]

    for i, (past, _) in enumerate(seqs):  # the cached prefixes
        if past:
            torch_paged.write_kv(cache, full_k[i][:past], full_v[i][:past], torch.tensor(slots(i, range(past))))
    qs = [torch.randn(new, heads, d) for _, new in seqs]
    meta = build_attention_metadata(
        slot_mapping=np.array([s for i, (past, new) in enumerate(seqs) for s in slots(i, range(past, past + new))]),
        query_start_loc=np.cumsum([0] + [new for _, new in seqs]),
        seq_lens=np.array([past + new for past, new in seqs]), block_tables=block_tables, block_size=bs,
        scratch_slot=nb * bs, device=torch.device("cpu"))
    q = torch.cat(qs)
    k = torch.cat([full_k[i][past:] for i, (past, _) in enumerate(seqs)])
    v = torch.cat([full_v[i][past:] for i, (past, _) in enumerate(seqs)])
    scale = d ** -0.5
    out = torch_paged.paged_attention(q, k, v, cache, meta, scale)
    row = 0
    for i, (past, new) in enumerate(seqs):
        ref = _dense_attention(qs[i].double().numpy(), full_k[i].double().numpy(), full_v[i].double().numpy(),
                               past, scale)
        np.testing.assert_allclose(out[row:row + new].double().numpy(), ref, atol=2e-5, err_msg=f"sequence {i}")
        row += new


def test_cpu_rotary_matches_rotate_half_formula():
    """The three-pass CPU rotation equals x·cos + rotate_half(x)·sin (Hugging Face's form),
    computed in float64, on a strided q/k view as the layer passes it."""
    from deepinfer.runtime.models.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 300, 10000.0, None)
    positions = torch.tensor([0, 1, 7, 150, 299])
    qkv = torch.randn(5, 20 * 64)
    x = qkv[:, :12 * 64].view(5, 12, 64)  # rows 20 heads apart, like q and k inside qkv
    got = RotaryEmbedding.rotate_one(rope.tables(positions, torch.float32), x)
    cos, sin = rope.cos[positions].double()[:, None], rope.sin[positions].double()[:, None]
    xd = x.double()
    ref = xd * cos + torch.cat((-xd[..., 32:], xd[..., :32]), dim=-1) * sin
    assert torch.allclose(got.double(), ref, rtol=0, atol=1e-6)
    # and bitwise what the two-rounding float32 form (Hugging Face's, the CUDA path's) gives
    cos32, sin32 = rope.tables(positions, torch.float32)
    assert torch.equal(got, x * cos32 + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin32)

"""Run by test_fused_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before triton loads),
and directly on a CUDA device by test_cuda_graphs_gpu.py: the fused Triton kernels
and the split-K decode attention against the torch ops they replace.

    python fused_kernels_check.py [cpu|cuda]
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F
from deepinfer.runtime.attention import torch_paged
from deepinfer.runtime.attention.metadata import build_attention_metadata
from deepinfer.runtime.attention.triton_decode import DecodeWorkspace, decode_attention
from deepinfer.runtime.kernels.fused_ops import (
    ROTARY_ALL_HEADS_FROM,
    add_rmsnorm,
    rotary_kv_write,
    silu_mul,
)
from deepinfer.runtime.kernels.gemv import (
    _argmax_partials_kernel,
    argmax_partials,
    gemv,
    gemv_argmax,
)
from deepinfer.runtime.models.llama import RMSNorm
from deepinfer.runtime.models.rotary import RotaryEmbedding

DEV = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
# float32: a few ulps (reduction order); bf16: one rounding step of the activation dtype.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = (torch.float32,) if DEV.type == "cpu" else (torch.float32, torch.bfloat16)


def check_add_rmsnorm(dtype: torch.dtype, g: torch.Generator) -> None:
    x, r = (torch.randn(5, 96, generator=g).to(DEV, dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
        out, res = add_rmsnorm(x, r, norm.weight, norm.eps)
        torch.testing.assert_close(res, x + r, atol=0, rtol=0)  # the sum rounds once, as torch's add
        torch.testing.assert_close(out, norm(x + r), **TOL[dtype])
        out1, res1 = add_rmsnorm(x, None, norm.weight, norm.eps)
        assert res1 is x
        torch.testing.assert_close(out1, norm(x), **TOL[dtype])


def check_rotary_kv(dtype: torch.dtype, g: torch.Generator, qk_norm: bool = False, t: int = 5) -> None:
    """``t`` >= ROTARY_ALL_HEADS_FROM: one program per token (10 heads in a 16-head tile), else one per head."""
    heads, kvh, d, bs, nb = 6, 2, 32, 16, 8
    rot = RotaryEmbedding(d, 256, 10000.0, None).to(DEV)
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g).to(DEV, dtype)
    if t == 5:
        pos = torch.tensor([0, 7, 31, 100, 255], dtype=torch.int32, device=DEV)
        slots = torch.tensor([3, 17, -1, 40, 95], dtype=torch.int64, device=DEV)
    else:
        pos = torch.randint(0, 256, (t,), generator=g, dtype=torch.int32).to(DEV)
        slots = torch.randperm(nb * bs, generator=g)[:t].to(DEV)
        slots[::7] = -1  # padding rows
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(DEV, dtype)
    ref_cache = cache.clone()
    qn, kn = RMSNorm(d, 1e-6).to(DEV, dtype), RMSNorm(d, 1e-6).to(DEV, dtype)
    with torch.no_grad():
        qn.weight.copy_(torch.rand(d, generator=g) + 0.5)
        kn.weight.copy_(torch.rand(d, generator=g) + 0.5)
    norms = (qn.weight, kn.weight, 1e-6) if qk_norm else None
    before = cache.clone()
    q = rotary_kv_write(qkv, pos, rot.cos, rot.sin, slots, cache, heads, kvh, norms, preload=False)
    # the step's inputs loaded before the PDL wait (kernels/pdl.py): the same bits
    cache_pre = before.clone()
    q_pre = rotary_kv_write(qkv, pos, rot.cos, rot.sin, slots, cache_pre, heads, kvh, norms, preload=True)
    assert torch.equal(q_pre, q) and torch.equal(cache_pre, cache)
    cs = rot.tables(pos.long(), dtype)
    qk = qkv[:, :(heads + kvh) * d].view(t, heads + kvh, d)
    if qk_norm:  # Qwen3: RMSNorm per q and k head before rotary (models.llama.LlamaLayer)
        with torch.no_grad():
            qk = torch.cat([qn(qk[:, :heads]), kn(qk[:, heads:])], dim=1)
    qk = RotaryEmbedding.rotate_one(cs, qk)
    v = qkv[:, (heads + kvh) * d:].view(t, kvh, d)
    keep = slots >= 0
    torch_paged.write_kv(ref_cache, qk[keep, heads:], v[keep], slots[keep])
    torch.testing.assert_close(q, qk[:, :heads], **TOL[dtype])
    torch.testing.assert_close(cache, ref_cache, **TOL[dtype])  # row with slot -1 wrote nothing


def check_silu_mul(dtype: torch.dtype, g: torch.Generator) -> None:
    gu = torch.randn(3, 2 * 1500, generator=g).to(DEV, dtype)
    gate, up = gu.split(1500, dim=-1)
    torch.testing.assert_close(silu_mul(gu), F.silu(gate) * up, **TOL[dtype])


def check_gemv(dtype: torch.dtype, g: torch.Generator) -> None:
    n, k = 300, 1100  # neither a multiple of the blocks: masked edges on both sides
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV, dtype)
    bias = torch.randn(n, generator=g).to(DEV, dtype)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    torch.testing.assert_close(gemv(x, w), F.linear(x, w), **TOL[dtype])
    torch.testing.assert_close(gemv(x, w, bias, config=(4, 256, 4, 2)), F.linear(x, w, bias), **TOL[dtype])
    gu = torch.randn(1, 2 * k, generator=g).to(DEV, dtype)
    torch.testing.assert_close(gemv(gu, w, silu_mul=True), F.linear(silu_mul(gu), w), **TOL[dtype])
    for config in ((4, 256, 4, 2), (16, 512, 4, 3)):
        logits, greedy = gemv_argmax(x, w, config)
        torch.testing.assert_close(logits, F.linear(x, w), **TOL[dtype])
        assert greedy.dtype == torch.int64 and int(greedy) == int(logits.argmax()), (greedy, logits.argmax())
    # the RMSNorm prologue (add_rmsnorm without a residual, then the projection) and the residual
    # add epilogue (the projection rounds, then the add rounds, as torch's ops)
    nw = (torch.rand(k, generator=g) + 0.5).to(DEV, dtype)
    xs = torch.randn(1, k, generator=g).to(DEV, dtype)
    res = torch.randn(1, n, generator=g).to(DEV, dtype)
    h_ref, _ = add_rmsnorm(xs, None, nw, 1e-5)
    with torch.no_grad():
        h_torch = RMSNorm(k, 1e-5).to(DEV, dtype)
        h_torch.weight.copy_(nw)
        torch.testing.assert_close(h_ref, h_torch(xs), **TOL[dtype])
    for config in ((4, 256, 4, 2), (8, 512, 4, 3)):
        torch.testing.assert_close(gemv(xs, w, bias, norm=(nw, 1e-5), config=config), F.linear(h_ref, w, bias),
                                   **TOL[dtype])
        torch.testing.assert_close(gemv(x, w, residual=res, config=config), F.linear(x, w) + res, **TOL[dtype])
        torch.testing.assert_close(gemv(gu, w, silu_mul=True, residual=res, config=config),
                                   F.linear(silu_mul(gu), w) + res, **TOL[dtype])
    # the whole [rows, K] tile loaded before the PDL wait (kernels/pdl.py) and the chunked loop
    w_odd = (torch.randn(301, k, generator=g) * 0.05).to(DEV, dtype)
    for preload in (False, True):
        torch.testing.assert_close(gemv(xs, w, bias, norm=(nw, 1e-5), preload=preload), F.linear(h_ref, w, bias),
                                   **TOL[dtype])
        torch.testing.assert_close(gemv(gu, w, silu_mul=True, residual=res, preload=preload),
                                   F.linear(silu_mul(gu), w) + res, **TOL[dtype])
        logits, greedy = gemv_argmax(x, w, (4, 256, 4, 2), preload=preload)
        torch.testing.assert_close(logits, F.linear(x, w), **TOL[dtype])
        assert int(greedy) == int(logits.argmax())
        # a last row block cut short (301 rows in blocks of 2 and 8)
        for config in ((2, 1024, 4, 3), (8, 512, 4, 3)):
            torch.testing.assert_close(gemv(x, w_odd, config=config, preload=preload), F.linear(x, w_odd),
                                       **TOL[dtype])
    # split-K: the last program of each row block adds the partials (6 splits: the last one empty)
    for config in ((4, 256, 4, 2, 3), (8, 256, 4, 2, 6)):
        torch.testing.assert_close(gemv(x, w, bias, config=config), F.linear(x, w, bias), **TOL[dtype])
        torch.testing.assert_close(gemv(gu, w, silu_mul=True, residual=res, config=config),
                                   F.linear(silu_mul(gu), w) + res, **TOL[dtype])
        torch.testing.assert_close(gemv(xs, w, norm=(nw, 1e-5), config=config), F.linear(h_ref, w), **TOL[dtype])
    # silu_out: gate/up [2N, K] whose epilogue stores SiLU(gate)·up; down after it equals down
    # with its own SiLU·mul input bit for bit, preloaded tile or chunked loop
    w_gu = (torch.randn(2 * n, k, generator=g) * 0.05).to(DEV, dtype)
    w_dn = (torch.randn(40, n, generator=g) * 0.05).to(DEV, dtype)
    res_dn = torch.randn(1, 40, generator=g).to(DEV, dtype)
    for config, preload in (((4, 256, 4, 2), False), ((2, 1024, 4, 3), True), ((8, 512, 4, 3), False)):
        gate_up = gemv(xs, w_gu, norm=(nw, 1e-5), config=config, preload=preload)
        act = gemv(xs, w_gu, norm=(nw, 1e-5), config=config, preload=preload, silu_out=True)
        torch.testing.assert_close(act, silu_mul(gate_up), **TOL[dtype])
        assert torch.equal(gemv(act, w_dn, residual=res_dn, config=(4, 256, 4, 2)),
                           gemv(gate_up, w_dn, silu_mul=True, residual=res_dn, config=(4, 256, 4, 2)))
    for bad_config in ((3, 256, 4, 2), (4, 256, 4, 2, 2)):  # odd BLOCK_N, split-K
        try:
            gemv(xs, w_gu, config=bad_config, silu_out=True)
        except ValueError as exc:
            assert "silu_out" in str(exc), exc
        else:
            raise AssertionError(f"gemv(silu_out=True) accepted {bad_config}")
    from deepinfer.runtime.kernels.gemv import _COUNTERS
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())  # left at 0 for the next call
    for bad in (dict(norm=(nw[:-1], 1e-5)), dict(residual=res[:, :-1]), dict(norm=(nw, 1e-5), silu_mul=True)):
        try:
            gemv(gu if bad.get("silu_mul") else xs, w, **bad)  # type: ignore[arg-type]
        except ValueError:
            pass
        else:
            raise AssertionError(f"gemv accepted {bad}")
    # ties inside one program (77, 78) and across programs: the first index wins, as in torch.argmax
    xt = torch.zeros(1, k, dtype=dtype, device=DEV)
    xt[0, 5] = 5.0
    wt = torch.zeros(3000, k, dtype=dtype, device=DEV)
    wt[[1234, 78, 77, 2999], 5] = 1.0
    _, greedy = gemv_argmax(xt, wt, (4, 256, 4, 2))
    assert int(greedy) == 77 == int(F.linear(xt, wt).argmax())
    if DEV.type == "cuda":  # more programs than ARGMAX_SPAN: the two passes, under PDL as in the graphs
        wt = torch.zeros(4500, k, dtype=dtype, device=DEV)  # 2,250 programs of 2 rows
        wt[[4400, 4300, 4301, 17], 5] = torch.tensor([1.0, 1.0, 1.0, 0.5], dtype=dtype, device=DEV)
        _, greedy = gemv_argmax(xt, wt, (2, 256, 4, 2))
        assert int(greedy) == 4300 == int(F.linear(xt, wt).argmax()), int(greedy)
    # the partials' reduction over several chunks of lanes (the 128k-vocabulary case), ties included
    maxes = torch.randn(100, generator=g).to(DEV)
    maxes[[13, 61, 97]] = 9.0
    args = torch.arange(100, device=DEV, dtype=torch.int64) * 4 + 1
    out = torch.empty(1, dtype=torch.int64, device=DEV)
    _argmax_partials_kernel[(1,)](maxes, args, out, maxes, 100, 100, BLOCK=16)
    assert int(out) == 13 * 4 + 1
    # two passes (argmax_partials: slices of `span` reduced in parallel, then their results): the
    # tie across slices (13, 61, 97 in slices 0, 3, 6 of 16), a tie inside the winning slice, a
    # slice of a single partial (span 1) and one slice of all (100, 128) give the first index
    for span in (16, 7, 1, 100, 128):
        out.fill_(-1)
        assert int(argmax_partials(maxes, args, out, span=span)) == 13 * 4 + 1, span
    maxes[[14, 15]] = 10.0  # the new largest twice inside one slice: its first wins
    assert int(argmax_partials(maxes, args, out, span=16)) == 14 * 4 + 1
    wide = torch.randn(70_000, generator=g).to(DEV)  # a 128k vocabulary's partials: more than ARGMAX_SPAN
    wide_args = torch.arange(70_000, device=DEV, dtype=torch.int64) * 2
    assert int(argmax_partials(wide, wide_args, out)) == int(wide.argmax()) * 2
    assert int(argmax_partials(wide, wide_args, out, span=70_000)) == int(wide.argmax()) * 2
    for bad_args, words in (((wide.double(), wide_args, out), "maxes float32"),
                            ((wide, wide_args[:-1], out), "args int64 [P]"),
                            ((wide, wide_args.int(), out), "args int64 [P]"),
                            ((wide, wide_args, out[:0]), "out int64"),
                            ((wide[::2], wide_args[::2], out), "contiguous")):
        try:
            argmax_partials(*bad_args)
        except ValueError as err:
            assert words in str(err), err
        else:
            raise AssertionError(f"argmax_partials accepted {words!r} wrong")
    try:
        argmax_partials(wide, wide_args, out, span=0)
    except ValueError as err:
        assert "span" in str(err), err
    else:
        raise AssertionError("argmax_partials accepted span 0")


def check_decode_attention(dtype: torch.dtype, g: torch.Generator, bs: int = 16) -> None:
    heads, kvh, d, nb = 6, 2, 64, 64
    lens = [1, 37, 200, 16, 513]
    tables = np.stack([np.random.default_rng(i).permutation(nb)[:40] for i in range(len(lens))]).astype(np.int32)
    cache = torch.randn(2, nb + 1, bs, kvh, d, generator=g).to(DEV, dtype)
    q = torch.randn(len(lens), heads, d, generator=g).to(DEV, dtype)
    meta = build_attention_metadata(slot_mapping=np.full(len(lens), -1), query_start_loc=np.arange(len(lens) + 1),
                                    seq_lens=np.array(lens), block_tables=tables, block_size=bs,
                                    scratch_slot=nb * bs, device=DEV)
    empty = torch.zeros(len(lens), kvh, d, dtype=dtype, device=DEV)
    ref = torch_paged.paged_attention(q.clone(), empty, empty, cache.clone(), meta, d ** -0.5)
    bt = torch.from_numpy(tables).to(DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for splits in (1, 3, 8):
        for preload in (False, True):  # the first tile of earlier tokens loaded before the PDL wait, or after
            out = decode_attention(q, cache, bt, sl, d ** -0.5, splits, fold_merge=False, preload=preload)
            torch.testing.assert_close(out, ref, **TOL[dtype])
    # the merge folded into the last split program: its counters go back to 0, so a second call
    # over the same workspace (as in a replayed graph) merges again; with 64 splits most hold no
    # tokens (they return at once and the merge reads only the used ones)
    ws = DecodeWorkspace(len(lens) * 64, heads, d, DEV)
    for splits, preload in ((3, True), (8, False), (8, True), (64, True)):
        out = decode_attention(q, cache, bt, sl, d ** -0.5, splits, ws, preload=preload)
        torch.testing.assert_close(out, ref, **TOL[dtype])
        assert int(ws.counters.abs().sum()) == 0
    # other tiles (DEEPINFER_DECODE_TILES, benchmarks): 16- and 32-position tiles with 2 warps, so a
    # context uses more splits and the merge reads more partials
    import os

    for tile in ("split=32,2", "split=16,2"):
        os.environ["DEEPINFER_DECODE_TILES"] = tile
        try:
            for splits, preload in ((8, True), (64, False)):
                out = decode_attention(q, cache, bt, sl, d ** -0.5, splits, ws, preload=preload)
                torch.testing.assert_close(out, ref, **TOL[dtype])
                assert int(ws.counters.abs().sum()) == 0
        finally:
            del os.environ["DEEPINFER_DECODE_TILES"]
    # a verify step's rows: the last new_rows positions of each context are read after the wait
    for splits, new_rows in ((1, 3), (8, 5), (64, 70)):
        out = decode_attention(q, cache, bt, sl, d ** -0.5, splits, ws, preload=True, new_rows=new_rows)
        torch.testing.assert_close(out, ref, **TOL[dtype])
    try:
        decode_attention(q, cache, bt, sl, d ** -0.5, 8, ws, new_rows=0)
    except ValueError:
        pass
    else:
        raise AssertionError("decode_attention accepted new_rows=0")
    try:  # a workspace without room for 5 rows x 3 splits
        decode_attention(q, cache, bt, sl, d ** -0.5, 3, DecodeWorkspace(2, heads, d, DEV))
    except ValueError as err:
        assert str(err).startswith("decode_attention: the workspace holds 2 partials"), err
    else:
        raise AssertionError("decode_attention accepted a workspace too small")


def check_quantized_output(dtype: torch.dtype, g: torch.Generator, d: int = 64) -> None:
    """The decode attention's output stored also as the GGUF dp4a GEMV's 8-bit activations
    (``quantized=``) equals ``_quantize_activations_kernel`` run on the output it stored: the same
    codes, scales and integer sums, float sums up to their summation order; for one split, the
    merge folded or separate, a group of 3 query heads (padded program rows) and a head size that
    is no power of two (d=80). Bad buffers are ValueErrors."""
    from deepinfer.runtime.kernels.gguf_gemv import quantize_activations

    heads, kvh, nb, bs = 6, 2, 240, 16
    lens = [1, 37, 200, 16, 513]
    tables = np.random.default_rng(1).permutation(nb)[:200].reshape(len(lens), 40).astype(np.int32)
    q = torch.randn(len(lens), heads, d, generator=g).to(DEV, dtype)
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(DEV, dtype)
    bt = torch.from_numpy(tables).to(DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ws = DecodeWorkspace(len(lens) * 8, heads, d, DEV)
    k = len(lens) * heads * d

    def buffers() -> tuple[torch.Tensor, torch.Tensor]:  # poisoned: every value must be written
        return (torch.full((k,), 99, dtype=torch.int8, device=DEV),
                torch.full((3 * (k // 16),), float("nan"), dtype=torch.float32, device=DEV))

    for splits, fold in ((1, True), (3, True), (8, True), (3, False)):
        xq, st = buffers()
        out = decode_attention(q, cache, bt, sl, d ** -0.5, splits, ws, fold_merge=fold, quantized=(xq, st))
        plain = decode_attention(q, cache, bt, sl, d ** -0.5, splits, ws, fold_merge=fold)
        assert torch.equal(out, plain), f"{splits} splits: the output changed with quantized="
        ref_q, ref_st = quantize_activations(out.reshape(1, k), k)
        kt = k // 16
        what = f"{splits} splits, fold {fold}, {dtype}, d={d}"
        assert torch.equal(xq, ref_q), f"{what}: codes differ at {(xq != ref_q).nonzero().flatten()[:8].tolist()}"
        assert torch.equal(st[:2 * kt], ref_st[:2 * kt]), f"{what}: scales or integer sums differ"
        torch.testing.assert_close(st[2 * kt:], ref_st[2 * kt:], atol=1e-5, rtol=1e-6)
        assert int(ws.counters.abs().sum()) == 0
    xq, st = buffers()
    for bad, words in (((xq[:-1], st), "codes must be"), ((xq, st[:-1]), "stats must be"),
                       ((xq.to(torch.int32), st), "codes must be")):
        try:
            decode_attention(q, cache, bt, sl, d ** -0.5, 3, ws, quantized=bad)
        except ValueError as err:
            assert str(err).startswith("decode_attention: quantized " + words), err
        else:
            raise AssertionError(f"decode_attention accepted quantized buffers ({words})")


def check_one_row_forward(arch: str, fp8: bool = False) -> None:
    """The decode forward of one sequence with the GEMV fusions (norm prologue, residual and
    SiLU·mul epilogues) gives the eager step's logits, and so does the cuBLAS + separate kernels path.
    ``fp8``: the projections quantized (models/fp8_linear.py): the fused path runs the fp8 GEMV,
    the eager step the layers' own forward (on CPU: their dequantized weights)."""
    import os
    import tempfile

    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward
    from deepinfer.runtime.worker.model_runner import ModelRunner
    from tiny_models import save_tiny_model

    if fp8:
        os.environ["DEEPINFER_CPU_NATIVE"] = "0"  # the native CPU decode reads float weights
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(tmp, arch)
        loaded = load_model(tmp, device=DEV, dtype=torch.float32)
        if fp8:
            from deepinfer.runtime.models.fp8_linear import quantize_model

            assert quantize_model(loaded.model, "fp8") == 4 * len(loaded.model.layers)
        runner = ModelRunner(loaded, num_blocks=8, block_size=4, device=DEV, dtype=torch.float32)
    for layer in runner.model.layers:  # CPU: plain nn.Linear views again (not CpuLinear's), so the
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):  # interpreter runs the GEMVs
            lin = getattr(layer, name)
            if type(lin).__name__ == "CpuLinear":
                plain = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
                plain.weight, plain.bias = lin.weight, lin.bias
                setattr(layer, name, plain)
    os.environ.pop("DEEPINFER_CPU_NATIVE", None)
    prompt, table = [5, 17, 33, 2, 99, 140, 7], np.array([[1, 2, 3]])
    n = len(prompt)
    pos = np.arange(n)
    runner.execute(input_ids=np.array(prompt), positions=pos, slot_mapping=table[0][pos // 4] * 4 + pos % 4,
                   query_start_loc=np.array([0, n]), seq_lens=np.array([n]), block_tables=table,
                   logits_indices=np.array([n - 1]))
    slot = int(table[0][n // 4] * 4 + n % 4)
    cfg = runner.config
    got = {}
    if fp8:  # the fusions' plumbing at float32 math: the float16 math's error (~1e-3) is bounded in
        # fp8_kernels_check.py against its own per-chunk reference
        os.environ["DEEPINFER_FP8_ONE_ROW_MATH"] = "f32"
    from deepinfer.runtime.models import llama_fused_decode

    one_row, paired = llama_fused_decode._one_row, []

    def spy(proj, x, name, **fusions):  # type: ignore[no-untyped-def]
        paired.append(bool(fusions.get("silu_out")))
        return one_row(proj, x, name, **fusions)

    llama_fused_decode._one_row = spy  # type: ignore[assignment]
    for names, silu_in_gate_up in (("qkv,o,gate_up,down", "0"), ("qkv,o,gate_up,down", "1"), ("none", "0")):
        os.environ["DEEPINFER_ONE_ROW_GEMV"] = names
        os.environ["DEEPINFER_SILU_IN_GATE_UP"] = silu_in_gate_up
        paired.clear()
        for cache in runner.kv_caches:  # each run must store the new token's k and v itself
            cache[:, slot // 4, slot % 4] = 0
        hidden = fused_decode_forward(
            runner.model, torch.tensor([12], dtype=torch.int32, device=DEV),
            torch.tensor([n], dtype=torch.int32, device=DEV), runner.kv_caches,
            torch.tensor([slot], device=DEV), torch.tensor(table, dtype=torch.int32, device=DEV),
            torch.tensor([n + 1], dtype=torch.int32, device=DEV),
            DecodeWorkspace(2, cfg.num_attention_heads, cfg.head_dim, DEV), 2)
        got[names + silu_in_gate_up] = runner.model.head_logits(hidden).float()
        assert paired.count(True) == (len(runner.model.layers) if silu_in_gate_up == "1" else 0), paired
    llama_fused_decode._one_row = one_row  # type: ignore[assignment]
    del os.environ["DEEPINFER_ONE_ROW_GEMV"], os.environ["DEEPINFER_SILU_IN_GATE_UP"]
    # SiLU·mul stored by gate/up's epilogue: the same bits as down's own SiLU·mul input
    assert torch.equal(got["qkv,o,gate_up,down1"], got["qkv,o,gate_up,down0"])
    # the reference: the eager step of one row, which on CUDA also runs the fp8 one-row GEMV, so
    # it takes the same float32 math (with the float16 default it was ~9e-3 off on the H200)
    ref = runner.execute(input_ids=np.array([12]), positions=np.array([n]), slot_mapping=np.array([slot]),
                         query_start_loc=np.array([0, 1]), seq_lens=np.array([n + 1]), block_tables=table,
                         logits_indices=np.array([0]))
    os.environ.pop("DEEPINFER_FP8_ONE_ROW_MATH", None)
    for logits in got.values():
        torch.testing.assert_close(logits, ref.to(DEV), atol=1e-4, rtol=1e-4)




def done(what: str) -> None:
    """One line a check as it passes: a run cut by a time limit shows how far it got (on a GPU
    each check compiles its kernels first)."""
    print(f"passed {what}", flush=True)


gen = torch.Generator().manual_seed(0)
for dt in DTYPES:
    check_add_rmsnorm(dt, gen)
    check_rotary_kv(dt, gen)
    check_rotary_kv(dt, gen, qk_norm=True)
    check_rotary_kv(dt, gen, t=ROTARY_ALL_HEADS_FROM + 6)
    check_rotary_kv(dt, gen, qk_norm=True, t=ROTARY_ALL_HEADS_FROM + 6)
    check_silu_mul(dt, gen)
    done(f"add_rmsnorm, rotary_kv_write, silu_mul {dt}")
    check_gemv(dt, gen)
    done(f"gemv {dt}")
    check_decode_attention(dt, gen)
    done(f"decode attention {dt}")
check_decode_attention(torch.float32, gen, bs=24)  # a block size that is no power of two
done("decode attention, block size 24")
for dt in (torch.float32, torch.bfloat16):
    check_quantized_output(dt, gen)
check_quantized_output(torch.bfloat16, gen, d=80)
done("decode attention stored as 8-bit activations")
check_one_row_forward("llama")
check_one_row_forward("qwen3")  # q/k norm (qkv bias: the GEMV's bias in check_gemv)
if DEV.type == "cpu" or torch.cuda.get_device_capability(DEV) >= (8, 9):
    check_one_row_forward("qwen2", fp8=True)  # qkv bias through the fp8 GEMV's epilogue
done("one-row forward")
print("ok")

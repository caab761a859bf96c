"""How much of the GGUF GEMM at 32 rows is decoding? Variants of the Q4_0 decode in a pared copy of
the swapped split-K GEMM (no masks, no bias, no PDL), timed in CUDA graphs on the Llama-3-8B
projections against cuBLAS bf16 and ``gguf_gemm`` itself (guide 08, "Codes to bfloat16 by bit
tricks"; a CUDA GPU):

    python bench/gguf_decode_variants.py

Variants: 0 the float32 decode (``_decode``'s arithmetic); 1 codes only, no scale (``gguf_gemv``'s
PTX: the floor of any decode); 2 codes and the bf16 scale in PTX; 3 the PTX codes times the scale
in Triton's bf16 (what ``gguf_gemm`` does); 4 float16 codes and scale (llama.cpp's dequantization)
with the activations converted to float16. Each prints its time and its error against a float32
product of the dense weights (variant 1: of the codes alone).
"""
import torch
import triton
import triton.language as tl
from deepinfer.runtime.kernels.gguf_gemv import (
    _NIBBLE_PAIRS,
    _NIBBLES_MINUS_136,
    _code_float,
    gguf_gemm,
)
from deepinfer.runtime.kernels.gguf_layout import GGUFPlanes

# the production nibble extraction (gguf_gemv._NIBBLE_PAIRS) with each pair then times its scale
# ($5-$8: the low and high nibbles' scales, two bf16 a register), and its float16 twin (0x6400 | n is
# 1024 + n; -1032 takes the bias off; llama.cpp's dequantization, one rounding)
_SCALED = (_NIBBLE_PAIRS.replace("C_PAIR", "0xC308C308")
           .replace("one, c;\nmov.b32 one", "one, c, nz;\nmov.b32 nz, 0x80008000;\nmov.b32 one")
           .replace("$0, t0,", "t0, t0,").replace("$1, t1,", "t1, t1,").replace("$2, u0,", "u0, u0,")
           .replace("$3, u1,", "u1, u1,")
           .replace("\n}\n", "".join(f"\nfma.rn.bf16x2 ${i}, {r}, ${i + 5}, nz;"
                                      for i, r in enumerate(("t0", "t1", "u0", "u1"))) + "\n}\n"))
ASM_SCALED = tl.constexpr(_SCALED)
ASM_F16 = tl.constexpr(_SCALED.replace("bf16x2", "f16x2").replace("0x43004300", "0x64006400")
                       .replace("0x3F803F80", "0x3C003C00").replace("0xC308C308", "0xE408E408"))


@triton.jit
def _bcast(s, BN: tl.constexpr, BK: tl.constexpr):
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // 32, 32)), (BN, BK))


@triton.jit
def gemm(x_ptr, q_ptr, s_ptr, ws_ptr, M, N, K, k_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         VAR: tl.constexpr):
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    rm = tl.arange(0, BM)
    m_ok = rm < M
    kc = K // 2
    ng = K // 32
    acc = tl.zeros([BN, BM], tl.float32)
    cols = tl.arange(0, BK)
    k_lo = tl.program_id(2) * k_split
    for k0 in range(k_lo, tl.minimum(kc, k_lo + k_split), BK):
        c = k0 + cols
        raw = tl.load(q_ptr + rn[:, None] * kc + c[None, :])
        gl = k0 // 32 + tl.arange(0, BK // 32)
        gh = (k0 + kc) // 32 + tl.arange(0, BK // 32)
        s_lo = tl.load(s_ptr + rn[:, None] * ng + gl[None, :])
        s_hi = tl.load(s_ptr + rn[:, None] * ng + gh[None, :])
        xl = tl.load(x_ptr + rm[None, :] * K + c[:, None], mask=m_ok[None, :], other=0.0)
        xh = tl.load(x_ptr + rm[None, :] * K + (c + kc)[:, None], mask=m_ok[None, :], other=0.0)
        if VAR == 0:  # production: float32 magic, float32 scale, rounded to bf16
            lo3 = tl.reshape(_code_float(raw & 0x0F, 8), (BN, BK // 32, 32))
            hi3 = tl.reshape(_code_float(raw >> 4, 8), (BN, BK // 32, 32))
            lo = tl.reshape(s_lo.to(tl.float32)[:, :, None] * lo3, (BN, BK)).to(tl.bfloat16)
            hi = tl.reshape(s_hi.to(tl.float32)[:, :, None] * hi3, (BN, BK)).to(tl.bfloat16)
        elif VAR == 1:  # codes only (q - 8) in bf16 by asm, no scale: the decode's floor
            lo, hi = tl.inline_asm_elementwise(_NIBBLES_MINUS_136, "=r,=r,=r,=r,r", [raw],
                                               dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
        elif VAR == 2:  # asm codes, bf16 scale multiplied in asm
            sl = _bcast(s_lo.to(tl.bfloat16), BN, BK)
            sh = _bcast(s_hi.to(tl.bfloat16), BN, BK)
            lo, hi = tl.inline_asm_elementwise(ASM_SCALED, "=r,=r,=r,=r,r,r,r,r,r", [raw, sl, sh],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif VAR == 3:  # asm codes, then Triton's bf16 multiply by the bf16 scale (3-D)
            lo, hi = tl.inline_asm_elementwise(_NIBBLES_MINUS_136, "=r,=r,=r,=r,r", [raw],
                                               dtype=(tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
            lo = tl.reshape(tl.reshape(lo, (BN, BK // 32, 32)) * s_lo.to(tl.bfloat16)[:, :, None], (BN, BK))
            hi = tl.reshape(tl.reshape(hi, (BN, BK // 32, 32)) * s_hi.to(tl.bfloat16)[:, :, None], (BN, BK))
        else:  # VAR 4: float16 weights (llama.cpp's dequant, one rounding), activations to float16
            sl = _bcast(s_lo, BN, BK)
            sh = _bcast(s_hi, BN, BK)
            lo, hi = tl.inline_asm_elementwise(ASM_F16, "=r,=r,=r,=r,r,r,r,r,r", [raw, sl, sh],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
            xl = xl.to(tl.float16)
            xh = xh.to(tl.float16)
        acc = tl.dot(lo, xl, acc)
        acc = tl.dot(hi, xh, acc)
    ws = ws_ptr + tl.program_id(2).to(tl.int64) * M * N
    tl.store(ws + rm[None, :] * N + rn[:, None], acc, mask=m_ok[None, :])


def run(x, q, s, n, k, splits, var, BN=64, BK=128, warps=4, stages=3):
    m = x.shape[0]
    kc = k // 2
    steps = triton.cdiv(kc, BK)
    k_split = triton.cdiv(steps, splits) * BK
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, BN), 1, splits)

    def fn():
        gemm[grid](x, q, s, ws, m, n, k, k_split, BM=32, BN=BN, BK=BK, VAR=var, num_warps=warps, num_stages=stages)
        return ws
    return fn


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1000


def main():
    torch.manual_seed(0)
    dev = "cuda"
    names = {0: "f32 decode (production)", 1: "asm codes, no scale (floor)", 2: "asm + bf16 scale in asm",
             3: "asm + Triton bf16 scale", 4: "asm f16 weights, f16 x"}
    for label, n, k, splits in (("gate_up", 28672, 4096, 2), ("down", 4096, 14336, 4), ("qkv", 6144, 4096, 4)):
        x = torch.randn(32, k, device=dev, dtype=torch.bfloat16)
        q = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8)
        s = (torch.rand(n, k // 32, device=dev) * 0.02 + 0.001).half()
        # reference: dense float32 weights
        codes = torch.cat([(q & 15), (q >> 4)], dim=1).float() - 8
        wd = codes * s.float().repeat_interleave(32, dim=1)
        ref = (x.float() @ wd.T)
        dense = wd.to(torch.bfloat16)
        t_cublas = timed(lambda x=x, dense=dense: x @ dense.T)
        line = [f"{label} 32 rows: cuBLAS bf16 {t_cublas:.1f} us"]
        try:
            w = GGUFPlanes("Q4_0", n, k, q, s)
            prod = gguf_gemm(x, w, swap=True, split_k=splits)
            err = float((prod.float() - ref).abs().max() / ref.abs().max())
            t_gemm = timed(lambda x=x, w=w, splits=splits: gguf_gemm(x, w, swap=True, split_k=splits))
            line.append(f"production gguf_gemm {t_gemm:.1f} us (err {err:.1e})")
        except Exception as e:  # noqa: BLE001
            line.append(f"production: {type(e).__name__}: {e}")
        print("; ".join(line), flush=True)
        for var in range(5):
            try:
                fn = run(x, q, s, n, k, splits, var)
                out = fn().sum(0)
                if var == 1:
                    err_ref = (x.float() @ codes.T)
                else:
                    err_ref = ref
                err = float((out - err_ref).abs().max() / err_ref.abs().max())
                print(f"  {names[var]}: {timed(fn):.1f} us (rel err {err:.1e})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {names[var]}: {type(e).__name__}: {str(e)[-600:]}", flush=True)


if __name__ == "__main__":
    main()

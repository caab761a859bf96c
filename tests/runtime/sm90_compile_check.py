"""Run by test_sm90_compile.py in a subprocess *without* TRITON_INTERPRET: compiles every Triton
kernel of a CUDA-graph decode step, as the H200 would run it, for compute capability 9.0 (PTX
and cubin through Triton's own ptxas) on a machine with no GPU. Nothing is launched.

Triton's interpreter runs a kernel's Python, so it cannot see what only the compiler rejects
(a name whose type changes between a constexpr branch and a loop, an unsupported op); such an
error then first shows on the GPU machine, a whole device session later. Here the model is built
on the meta device (shapes, no memory), a driver that reports an sm_90 GPU stands in for the CUDA
one, and each ``kernel[grid](...)`` compiles (``warmup``) instead of launching. The kernels and
their constexprs are the ones a real step picks: ``fused_decode_forward`` and the graph's LM head
at batch 1 (the one-row GEMVs) and at a few rows (the few-token MoE kernels), an eager step
(``fused_step_forward``: a prompt chunk and a decode row), and the GGUF one-row GEMV of each GPU
type at the Llama-3-8B projections' K, each with the PDL prefetch off and on.

    python sm90_compile_check.py [SHAPE ...] [gguf] [others]    # names from gpu_shapes.SHAPES

``others``: the kernels outside a bf16 decode step, once (they have no prefetch form): the FP8
weight kernels, the GGUF several-row GEMM and MMQ, the structured-output masks; and the GGUF GEMM
at the choices decode graphs and prompts make, with its registers and stack frame read back from
the cubin (Triton's cuobjdump): a line starting "SPILL" says a default choice spills registers.

Prints one line per (shape, batch, prefetch) with the kernels it compiled; exits non-zero on the
first compile error (its message names the kernel).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("sm90_compile_check.py compiles for the GPU: run it without TRITON_INTERPRET=1")

from gpu_shapes import SHAPES, write_shape_dir
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
compiled: Counter[str] = Counter()
# (kernel name, compiled kernel, launch keywords) of each launch while ``recording`` is on (``_recorded``)
recorded: list[tuple[str, Any, dict[str, Any]]] = []
recording = False


class CompileOnlyDriver:
    """What JITFunction.run asks of the active driver before it compiles: a device, a stream and
    the target (the launch itself never happens here)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET


def _compile_instead_of_launch(self: JITFunction, grid: Any) -> Any:
    def launch(*args: Any, **kwargs: Any) -> Any:
        kernel = self.run(*args, grid=grid, warmup=True, **kwargs)  # compiles (cached), no launch
        assert kernel.asm.get("cubin"), f"{self.fn.__name__}: no cubin"
        compiled[self.fn.__name__] += 1
        if recording:
            recorded.append((self.fn.__name__, kernel, kwargs))
        return kernel
    return launch


def _cuobjdump() -> str | None:
    """Triton's own cuobjdump (its NVIDIA backend ships one), or None."""
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else None


def _cuobjdump_of(cubin: bytes, flag: str) -> str | None:
    """What Triton's cuobjdump prints for a cubin with ``flag``, or None without cuobjdump."""
    import subprocess

    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def _registers_and_stack(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack frame bytes) of a compiled kernel, as cuobjdump reads its cubin; a
    stack frame in these kernels means registers spilled to local memory. (-1, -1) without cuobjdump."""
    import re

    out = _cuobjdump_of(cubin, "--dump-resource-usage")
    if out is None:
        return -1, -1
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert found, out
    return int(found.group(1)), int(found.group(2))


def install() -> None:
    driver.set_active(CompileOnlyDriver())  # type: ignore[arg-type]
    JITFunction.__getitem__ = _compile_instead_of_launch  # type: ignore[method-assign]
    from deepinfer.runtime.kernels import pdl
    from deepinfer.runtime.models import moe

    pdl.pdl_enabled = lambda device: True  # the H200's launches: PDL constexprs and launch option on
    moe.KERNELS_ON_CPU = True  # the MoE layer picks its Triton kernels for meta tensors too


@contextlib.contextmanager
def _recorded(name: str) -> Iterator[list[tuple[Any, dict[str, Any]]]]:
    """The (compiled kernel, launch keywords) of each launch of kernel ``name`` inside the block, in
    the list yielded (filled as the block runs)."""
    global recording
    found: list[tuple[Any, dict[str, Any]]] = []
    recorded.clear()
    recording = True
    try:
        yield found
    finally:
        recording = False
        found.extend((kernel, kwargs) for fn, kernel, kwargs in recorded if fn == name)
        recorded.clear()


def _meta_planes(kind: str, n: int, k: int) -> Any:
    """``kind``'s GPU planes of a random [n, k] weight, moved to the meta device."""
    from deepinfer.runtime.kernels.gguf_layout import regroup
    from gguf_gpu_check import random_blocks

    return regroup(torch.from_numpy(random_blocks(kind, n, k, seed=0)), kind).map(lambda t: t.to(torch.device("meta")))


def _meta_model(shape: str) -> tuple[Any, list[torch.Tensor], Any]:
    """``shape``'s model (one layer; DeepSeek: its dense layer 0 and an MoE layer) with bf16
    weights, and KV caches of 64 blocks of 16, all on the meta device."""
    from deepinfer.runtime.loading.model_loader import model_class, read_config

    with tempfile.TemporaryDirectory() as d:
        cfg = read_config(write_shape_dir(d, shape))
    cfg.num_hidden_layers = 1 if cfg.moe is None or cfg.mla is None else 2
    meta = torch.device("meta")
    with meta:
        model = model_class(cfg)(cfg, max_positions=4096)
    for param in model.parameters():  # bf16 weights; the rotary tables stay float32 (as loading leaves them)
        param.data = torch.empty_like(param, dtype=torch.bfloat16)
    model.rotary.to(meta)
    planes, heads, dim = cfg.kv_cache_layout()
    caches = [torch.empty(planes, 65, 16, heads, dim, dtype=torch.bfloat16, device=meta)
              for _ in range(cfg.num_hidden_layers)]
    return model, caches, cfg


def decode_step(shape: str, batch: int) -> None:
    """One graph decode step of ``shape`` (one layer of it: every layer compiles the same
    kernels) at ``batch`` rows, on meta tensors."""
    from deepinfer.runtime.attention.triton_decode import DecodeWorkspace, choose_num_splits
    from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward
    from deepinfer.runtime.worker.cuda_graph_runner import (
        LM_HEAD_GEMV_CONFIG,
        LM_HEAD_GEMV_CONFIG_SMALL_K,
    )

    model, caches, cfg = _meta_model(shape)
    meta = torch.device("meta")
    block_size, blocks = 16, 64
    ids = torch.empty(batch, dtype=torch.int32, device=meta)
    pos = torch.empty(batch, dtype=torch.int32, device=meta)
    slots = torch.empty(batch, dtype=torch.int64, device=meta)
    bt = torch.empty(batch, blocks, dtype=torch.int32, device=meta)
    seq_lens = torch.empty(batch, dtype=torch.int32, device=meta)
    splits = choose_num_splits(batch, cfg.num_key_value_heads, blocks * block_size)
    ws = DecodeWorkspace(batch * splits, cfg.num_attention_heads, cfg.head_dim, meta)
    with torch.no_grad():
        graph_forward = getattr(model, "graph_decode_forward", None)
        if graph_forward is not None:  # MLA models (DeepSeek): their own forward, the MLA decode kernel
            from deepinfer.runtime.attention.triton_mla import choose_mla_splits

            hidden = graph_forward(ids, pos, caches, slots, bt, seq_lens,
                                   choose_mla_splits(batch, cfg.num_attention_heads, blocks * block_size, 132))
        else:  # at 4 rows as a verify graph's rows (3 drafts: 4 new positions a row) read them
            hidden = fused_decode_forward(model, ids, pos, caches, slots, bt, seq_lens, ws, splits,
                                          new_rows=1 if batch == 1 else 4)
        if batch == 1:
            from deepinfer.runtime.kernels.gemv import gemv_argmax

            w = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
            gemv_argmax(hidden, w, LM_HEAD_GEMV_CONFIG if w.shape[1] >= 2048 else LM_HEAD_GEMV_CONFIG_SMALL_K)


def eager_step(shape: str) -> None:
    """One eager step of ``shape`` through ``fused_step_forward`` (what CUDA steps outside the
    graphs run): a 7-token prompt chunk and a decode row, with the var-len Triton attention."""
    import numpy as np
    from deepinfer.runtime.attention.metadata import build_attention_metadata
    from deepinfer.runtime.models.llama_fused_decode import fused_step_forward

    model, caches, _ = _meta_model(shape)
    meta = torch.device("meta")
    qsl = np.array([0, 7, 8])
    attn = build_attention_metadata(slot_mapping=np.arange(8), query_start_loc=qsl, seq_lens=np.array([7, 20]),
                                    block_tables=np.arange(8).reshape(2, 4), block_size=16, scratch_slot=1024,
                                    device=meta)
    ids = torch.empty(8, dtype=torch.int64, device=meta)
    pos = torch.empty(8, dtype=torch.int64, device=meta)
    with torch.no_grad():
        fused_step_forward(model, ids, pos, caches, attn)


def gguf_one_row(kind: str) -> None:
    """The GGUF GEMV of ``kind`` as a Llama-3-8B layer calls it at batch 1: qkv with the RMSNorm
    (K 4096), down with SiLU·mul and the residual (K 14336); and o with the residual from the
    8-bit activations that the decode attention stores (``DEEPINFER_GGUF_O_QUANT_IN_ATTENTION``),
    that attention too (folded merge, separate merge)."""
    from deepinfer.runtime.attention.triton_decode import decode_attention
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemv

    meta = torch.device("meta")
    k = 4096
    xq, st = (torch.empty(k, dtype=torch.int8, device=meta), torch.empty(3 * k // 16, dtype=torch.float32, device=meta))
    cache = torch.empty(2, 64, 16, 8, 128, dtype=torch.bfloat16, device=meta)
    bt, one = torch.empty(1, 64, dtype=torch.int32, device=meta), torch.empty(1, dtype=torch.int32, device=meta)
    for fold in (True, False):
        decode_attention(torch.empty(1, 32, 128, dtype=torch.bfloat16, device=meta), cache, bt, one, 0.088, 4,
                         fold_merge=fold, quantized=(xq, st))
    planes = _meta_planes(kind, 8, k)
    gguf_gemv(torch.empty(1, k, dtype=torch.bfloat16, device=meta), planes,
              residual=torch.empty(1, 8, dtype=torch.bfloat16, device=meta), quantized=(xq, st))
    for k, fusions in ((4096, "norm"), (14336, "silu_mul")):
        planes = _meta_planes(kind, 8, k)
        if fusions == "norm":
            x = torch.empty(1, k, dtype=torch.bfloat16, device=meta)
            gguf_gemv(x, planes, norm=(torch.empty(k, dtype=torch.bfloat16, device=meta), 1e-5))
        else:
            x = torch.empty(1, 2 * k, dtype=torch.bfloat16, device=meta)
            gguf_gemv(x, planes, silu_mul=True, residual=torch.empty(1, 8, dtype=torch.bfloat16, device=meta))


def fp8_kernels() -> None:
    """The FP8 weight kernels at a Llama-3-8B K: the one-row GEMV in each of its maths (with the
    RMSNorm; SiLU·mul + residual; RMSNorm + SiLU·mul out; 4 row tiles a program), the weight-only
    GEMM at 4 and 64 rows, the W8A8 GEMM."""
    from deepinfer.runtime.kernels.fp8_act import fp8_w8a8_gemm
    from deepinfer.runtime.kernels.fp8_gemv import MATHS, fp8_gemm, fp8_gemv

    meta, bf16 = torch.device("meta"), torch.bfloat16
    w = torch.empty(64, 4096, dtype=torch.float8_e4m3fn, device=meta)
    scale = torch.empty(64, dtype=torch.float32, device=meta)
    for math in MATHS:
        fp8_gemv(torch.empty(1, 4096, dtype=bf16, device=meta), w, scale, math=math,
                 norm=(torch.empty(4096, dtype=bf16, device=meta), 1e-5))
        fp8_gemv(torch.empty(1, 8192, dtype=bf16, device=meta), w, scale, math=math, silu_mul=True,
                 residual=torch.empty(1, 64, dtype=bf16, device=meta))
        fp8_gemv(torch.empty(1, 4096, dtype=bf16, device=meta), w, scale, math=math, silu_out=True,
                 norm=(torch.empty(4096, dtype=bf16, device=meta), 1e-5))
        fp8_gemv(torch.empty(1, 4096, dtype=bf16, device=meta), w, scale, math=math,  # 4 row tiles a program
                 config=(16 if math == "mma" else 4, 4096, 8, 2, 4), norm=(torch.empty(4096, dtype=bf16, device=meta),
                                                                           1e-5))
    for rows in (4, 64):
        fp8_gemm(torch.empty(rows, 4096, dtype=bf16, device=meta), w, scale)
    fp8_w8a8_gemm(torch.empty(32, 4096, dtype=bf16, device=meta), w, scale)


def gguf_several_rows(kind: str) -> None:
    """The GGUF kernels of several rows: the GEMM (4 rows; 20 rows swapped and split, as a decode
    graph runs it; its bf16 decode, the default, and the float32 one), the int8 MMQ (64 rows) and
    the whole weight's decode (``DEEPINFER_GGUF_DENSE_ROWS``)."""
    from deepinfer.runtime.kernels.gguf_gemv import dense_weight, gguf_gemm
    from deepinfer.runtime.kernels.gguf_mmq import gguf_mmq, quantize_rows
    from gguf_gpu_check import environment

    meta = torch.device("meta")
    planes = _meta_planes(kind, 8, 4096)
    gguf_gemm(torch.empty(4, 4096, dtype=torch.bfloat16, device=meta), planes)
    gguf_gemm(torch.empty(20, 4096, dtype=torch.bfloat16, device=meta), planes, swap=True, split_k=2)  # graphs' tile
    with environment(DEEPINFER_GGUF_GEMM_DECODE="f32"):
        gguf_gemm(torch.empty(4, 4096, dtype=torch.bfloat16, device=meta), planes)
    gguf_mmq(quantize_rows(torch.empty(64, 4096, dtype=torch.bfloat16, device=meta)), planes)
    dense_weight(planes, torch.bfloat16)


def gguf_gemm_defaults(kind: str) -> tuple[bool, str]:
    """The several-row GEMM of ``kind`` at the choices a decode graph makes for 8, 20 and 32 rows
    (tile, swap; K unsplit and split) and a 64-row prompt makes, compiled with its registers and
    stack frame read back. Returns (whether any spilled, the text per row count and split)."""
    from deepinfer.runtime.kernels.gguf_gemv import gemm_swapped, gemm_tuning_kind, gguf_gemm

    meta = torch.device("meta")
    planes = _meta_planes(kind, 128, 4096)  # 128 weight rows: whole tiles along N, as an 8B projection's
    cells, spilled = [], False
    for rows, split in ((8, 1), (8, 2), (20, 1), (20, 2), (32, 1), (32, 2), (64, 1)):
        # K unsplit (a wide projection: the LM head) and split (narrow ones), as graphs choose
        with _recorded("_gguf_gemm_kernel") as gemms:
            gguf_gemm(torch.empty(rows, 4096, dtype=torch.bfloat16, device=meta), planes,
                      swap=gemm_swapped(gemm_tuning_kind(planes), rows, True), split_k=split)
        regs, stack = _registers_and_stack(gemms[0][0].asm["cubin"])
        cells.append(f"{rows}/{split} {regs}" + (f" + stack {stack} B" if stack > 0 else ""))
        spilled |= stack > 0
    return spilled, "registers at rows/K splits " + ", ".join(cells)


def _sass(cubin: bytes) -> list[str]:
    """The SASS instructions of a cubin, in address order (Triton's cuobjdump)."""
    import re

    out = _cuobjdump_of(cubin, "-sass")
    assert out is not None, "Triton's cuobjdump is missing"
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", out)]


def _main_loop(sass: list[str]) -> list[str]:
    """The instructions of the longest loop: from a backward branch's target to the branch."""
    import re

    at = {i * 16: i for i in range(len(sass))}  # sm_90 instructions are 16 bytes
    best = (0, -1)
    for i, ins in enumerate(sass):
        m = re.search(r"BRA 0x([0-9a-f]+)", ins)
        if m and at.get(int(m.group(1), 16), i) < i and i - at[int(m.group(1), 16)] > best[1] - best[0]:
            best = (at[int(m.group(1), 16)], i)
    return sass[best[0]:best[1] + 1]


def gguf_word_gemv_loop(kind: str, at: str = "qkv", lean: bool = False, budget: bool = False) -> tuple[bool, str]:
    """The dp4a word GEMV of ``kind`` at a Llama-3-8B shape (``at``: qkv, 6144 x 4096, or down, 4096 x
    14336 with its residual epilogue: a narrow projection's tile), compiled for sm_90 (``lean``:
    ``DEEPINFER_GGUF_GEMV_LEAN=1``; ``budget``: ``DEEPINFER_GGUF_GEMV_MAXNREG=1``, the default form
    with the lean form's register budget): its registers, its loop's instructions per weight byte, and
    whether the loop issues every load (the rows' code words and scales, the activations) before
    its first ``dp4a`` (with no stack frame: none spilled): one memory latency a pass. Returns (that,
    the text). Where loads sat next to their uses instead (ptxas placed unmasked loads so), the GEMV
    lost 22-27 % on the H200 (guide 08): the test fails on it."""
    from deepinfer.runtime.kernels.gguf_gemv import gguf_gemv
    from gguf_gpu_check import environment

    meta = torch.device("meta")
    n, k = {"qkv": (6144, 4096), "down": (4096, 14336)}[at]
    planes = _meta_planes(kind, n, k)
    residual = torch.empty(1, n, dtype=torch.bfloat16, device=meta) if at == "down" else None
    # as a decode graph launches it: PDL on, no preload before the wait (the default)
    with (environment(DEEPINFER_PDL_PREFETCH="0", DEEPINFER_GGUF_GEMV_LEAN="1" if lean else "0",
                      DEEPINFER_GGUF_GEMV_MAXNREG="1" if budget else "0"),
          _recorded("_gguf_gemv_words_kernel") as gemvs):
        gguf_gemv(torch.empty(1, k, dtype=torch.bfloat16, device=meta), planes, residual=residual)
    kernel, meta_args = gemvs[0]
    assert meta_args["LEAN"] == lean, f"{kind} at {at}: the lean form was {'not ' if lean else ''}taken"
    loop = _main_loop(_sass(kernel.asm["cubin"]))
    first_dot = next(i for i, ins in enumerate(loop) if "IDP" in ins)
    together = all(i < first_dot for i, ins in enumerate(loop) if "LDG" in ins)
    per_thread = meta_args["ROWS"] * meta_args["BLOCK_W"] * 4 // (meta_args["num_warps"] * 32)
    regs, stack = _registers_and_stack(kernel.asm["cubin"])
    order = "".join("L" if "LDG" in ins else "d" if "IDP" in ins else "" for ins in loop)
    spilled = f" + stack {stack} B" if stack else ""
    return together and stack == 0, (f"{regs} registers{spilled}, loop {len(loop)} instructions for {per_thread} "
                                     f"weight bytes a thread ({len(loop) / per_thread:.2f} a byte), loads/dp4a "
                                     f"order {order}")


def greedy_picks() -> None:
    """The argmax of decode graphs whose head does not fold it (bf16 logits), and the
    structured-output kernels: the masked argmax of the decode graphs and the logit mask."""
    from deepinfer.runtime.kernels.argmax import argmax_rows
    from deepinfer.runtime.kernels.grammar_mask import mask_logits_, masked_argmax_, packed_size

    meta, vocab = torch.device("meta"), 49152
    argmax_rows(torch.empty(1, 128256, dtype=torch.bfloat16, device=meta))
    words = vocab // 32
    logits = torch.empty(8, vocab, dtype=torch.float32, device=meta)
    packed = torch.empty(packed_size(8, 8, words), dtype=torch.int32, device=meta)
    masked_argmax_(torch.empty(8, dtype=torch.int64, device=meta), logits, packed, 8, words)
    mask_logits_(logits, torch.empty(2, dtype=torch.int64, device=meta),
                 torch.empty(2, words, dtype=torch.int32, device=meta))


def _report(what: str) -> None:
    kernels = ", ".join(f"{name} x{n}" for name, n in sorted(compiled.items()))
    print(f"ok   {what}: {kernels}", flush=True)
    compiled.clear()


def main(args: list[str]) -> None:
    install()
    from gguf_gpu_check import environment  # (after install(): it imports the GGUF kernels)

    for prefetch in ("0", "1"):
        os.environ["DEEPINFER_PDL_PREFETCH"] = prefetch
        for shape in (a for a in args if a not in ("gguf", "others")):
            for batch in (1, 4):
                decode_step(shape, batch)
                _report(f"{shape} batch {batch} prefetch {prefetch}")
            if shape == "qwen3-30b-a3b":  # the router in the o projection's launch (DEEPINFER_MOE_ROUTER_IN_O)
                with environment(DEEPINFER_MOE_ROUTER_IN_O="1"):
                    decode_step(shape, 1)
                _report(f"{shape} batch 1 router in o, prefetch {prefetch}")
                with environment(DEEPINFER_MOE_DOWN_ONE_SUM="1"):  # the down kernel's slots reduced once
                    decode_step(shape, 1)
                _report(f"{shape} batch 1 down slots reduced once, prefetch {prefetch}")
            if shape == "llama3-8b":  # SiLU·mul in the gate/up GEMV's epilogue (DEEPINFER_SILU_IN_GATE_UP)
                with environment(DEEPINFER_SILU_IN_GATE_UP="1"):
                    decode_step(shape, 1)
                _report(f"{shape} batch 1 silu in gate/up, prefetch {prefetch}")
            if "kv_lora_rank" not in SHAPES[shape]:  # MLA models take no fused eager step
                eager_step(shape)
                _report(f"{shape} eager step prefetch {prefetch}")
        if "gguf" in args:
            from deepinfer.runtime.kernels.gguf_layout import GPU_TYPES

            for kind in GPU_TYPES:
                gguf_one_row(kind)
                _report(f"gguf {kind} one row prefetch {prefetch}")
            with environment(DEEPINFER_GGUF_Q6K_6BIT="1"):  # Q6_K's codes at 6 bits (planes made at regroup)
                gguf_one_row("Q6_K")
            _report(f"gguf Q6_K at 6 bits one row prefetch {prefetch}")
    if "others" in args:  # no prefetch form: once
        fp8_kernels()
        _report("fp8 one row (every math), gemm, w8a8")
        from deepinfer.runtime.kernels.gguf_layout import GPU_TYPES

        for kind in GPU_TYPES:
            gguf_several_rows(kind)
            _report(f"gguf {kind} several rows")
        with environment(DEEPINFER_GGUF_Q6K_6BIT="1"):
            gguf_several_rows("Q6_K")
        _report("gguf Q6_K at 6 bits several rows")
        # the GEMM's default choices must not spill registers (a stack frame): "SPILL" fails the test
        # (and 6-bit Q6_K with K steps of 64, DEEPINFER_GGUF_Q6K_6BIT_TUNING=packed-k64)
        for kind, six, tuning in [*((k, "0", "packed") for k in GPU_TYPES), ("Q6_K", "1", "packed"),
                                  ("Q6_K", "1", "packed-k64")]:
            with environment(DEEPINFER_GGUF_Q6K_6BIT=six, DEEPINFER_GGUF_Q6K_6BIT_TUNING=tuning):
                spilled, text = gguf_gemm_defaults(kind)
            what = f"{kind} at 6 bits" if six == "1" else kind
            what += ", K steps of 64" if tuning == "packed-k64" else ""
            print(f"{'SPILL' if spilled else 'ok  '} gguf {what} GEMM default choices: {text}", flush=True)
            compiled.clear()
        # the word GEMV's loads of a pass in flight together: "SCATTERED" fails the test, but for the
        # default loops it names as known (Q4_1; Q4_0 at down)
        # (at qkv, then at down: a narrow projection's tile; then the experimental lean form at both, and
        # the default form with the lean form's register budget at both)
        for kind in GPU_TYPES:
            for at, form in (("qkv", ""), ("down", ""), ("qkv", "lean "), ("down", "lean "), ("qkv", "budget "),
                             ("down", "budget ")):
                together, text = gguf_word_gemv_loop(kind, at, form == "lean ", form == "budget ")
                what = form + "word GEMV loop" + ("" if at == "qkv" and not form else f" at {at}")
                print(f"{'ok  ' if together else 'SCATTERED'} gguf {kind} {what}: {text}", flush=True)
                compiled.clear()
        greedy_picks()
        _report("argmax rows, grammar masks")


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2-135m"])

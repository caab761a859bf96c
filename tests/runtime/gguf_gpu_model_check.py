"""Test helper: a tiny Llama GGUF whose projections mix every GPU kernel type (as a Q4_K_M file
mixes Q4_K and Q6_K), loaded with its weights kept quantized (``GGUFLinearCUDA``), against the
same file dequantized.

``python gguf_gpu_model_check.py cpu``  (with ``TRITON_INTERPRET=1``): the model's logits for a
prompt of 5 tokens (the GEMM), then one decode token (the GEMV), then one through the fused
one-row decode forward (the GEMV's RMSNorm / residual / SiLU·mul fusions), float32 activations,
against the dense float32 model of the same file: the weights are the same numbers, so only the
float32 summation order differs (bound ``1e-4 * max |logit|``).
``python gguf_gpu_model_check.py cuda``: ``LLM(path, quantization="gguf")`` (quantized, CUDA graphs,
overlap scheduling, the fused one-row decode) against ``LLM(path, dtype="bfloat16")`` (dequantized
at load): greedy tokens of 6 prompts, alone and as one batch; prints the agreement and, at each
first divergence, the dense run's logprob gap between the two tokens (a near-tie when small).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

H, HEADS, KV, HD, FF, L, V = 256, 4, 2, 64, 512, 2, 384
# per layer: tensor -> type (layer 1 swaps some, so a fused projection also sees one type)
TYPES = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
          "ffn_up": "Q4_1", "ffn_down": "Q5_K"},
         {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q6_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K"}]
HEAD_TYPE = "Q6_K"


def write_mixed_gguf(path: str, seed: int = 0) -> str:
    import gguf
    from gguf_quantizer import quantize

    g = torch.Generator().manual_seed(seed)
    shapes = {"attn_q": (HEADS * HD, H), "attn_k": (KV * HD, H), "attn_v": (KV * HD, H),
              "attn_output": (H, HEADS * HD), "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}
    w = gguf.GGUFWriter(path, "llama")
    for key, value in {"llama.embedding_length": H, "llama.attention.head_count": HEADS,
                       "llama.attention.head_count_kv": KV, "llama.feed_forward_length": FF,
                       "llama.block_count": L, "llama.context_length": 512, "llama.vocab_size": V}.items():
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    # a tokenizer (LLM loads one): SentencePiece-style tokens with scores, as transformers needs
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([1] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_float32("llama.rope.freq_base", 10000.0)

    def add_quant(name: str, shape: tuple[int, int], kind: str, std: float) -> None:
        raw = quantize(torch.randn(shape, generator=g) * std, kind).numpy()
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    w.add_tensor("token_embd.weight", (torch.randn(V, H, generator=g) * 0.5).numpy())
    w.add_tensor("output_norm.weight", (1 + 0.1 * torch.randn(H, generator=g)).numpy())
    add_quant("output.weight", (V, H), HEAD_TYPE, 0.15)
    for i in range(L):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * torch.randn(H, generator=g)).numpy())
        for t, shape in shapes.items():
            add_quant(f"blk.{i}.{t}.weight", shape, TYPES[i][t], shape[1] ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check_cpu(path: str) -> bool:
    from deepinfer.runtime.attention.metadata import build_attention_metadata
    from deepinfer.runtime.attention.torch_paged import paged_attention
    from deepinfer.runtime.loading.gguf_gpu_loader import keep_gguf_quantization_cuda
    from deepinfer.runtime.loading.gguf_loader import GGUFModel
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA

    cpu = torch.device("cpu")
    dense = load_model(path, device=cpu, dtype=torch.float32, max_positions=64).model
    quant = load_model(path, device=cpu, dtype=torch.float32, max_positions=64).model
    keep_gguf_quantization_cuda(quant, GGUFModel(path), cpu, torch.float32)
    kinds = {type(m).__name__ for m in quant.modules()}
    types = sorted({m.weight_type for m in quant.modules() if isinstance(m, GGUFLinearCUDA)})
    print("quantized layers:", types, "head:", getattr(quant.quantized_head, "weight_type", None))
    ok = "GGUFLinearCUDA" in kinds and isinstance(quant.quantized_head, GGUFLinearCUDA)
    ok &= {"Q4_K+Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q4_K"} <= set(types)
    prompt = [3, 17, 250, 9, 101]
    caches = {id(m): [torch.zeros(2, 2, 16, KV, HD) for _ in range(L)] for m in (dense, quant)}
    for ids in (prompt, [42]):  # a prompt (the GEMM), then one decode token (the GEMV) after it
        n, start = len(ids), 0 if len(ids) > 1 else len(prompt)
        meta = build_attention_metadata(slot_mapping=np.arange(start, start + n), query_start_loc=np.array([0, n]),
                                        seq_lens=np.array([start + n]), block_tables=np.zeros((1, 1), np.int32),
                                        block_size=16, scratch_slot=31, device=cpu)
        logits = []
        for model in (dense, quant):
            with torch.no_grad():
                h = model(torch.tensor(ids), torch.arange(start, start + n), caches[id(model)], meta, paged_attention)
                logits.append(model.compute_logits(h))
        ok &= _close(f"{n} token(s), eager", logits[1], logits[0])
    # the fused one-row decode forward (norm prologue, residual epilogue, SiLU·mul input in the
    # quantized GEMV) for the next token, against the dense model's eager step
    from deepinfer.runtime.attention.triton_decode import DecodeWorkspace
    from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward

    pos = len(prompt) + 1
    i32 = torch.int32
    h = fused_decode_forward(quant, torch.tensor([7], dtype=i32), torch.tensor([pos], dtype=i32), caches[id(quant)],
                             torch.tensor([pos]), torch.zeros((1, 1), dtype=i32), torch.tensor([pos + 1], dtype=i32),
                             DecodeWorkspace(2, HEADS, HD, cpu), 2)
    meta = build_attention_metadata(slot_mapping=np.array([pos]), query_start_loc=np.array([0, 1]),
                                    seq_lens=np.array([pos + 1]), block_tables=np.zeros((1, 1), np.int32),
                                    block_size=16, scratch_slot=31, device=cpu)
    with torch.no_grad():
        ref = dense.compute_logits(dense(torch.tensor([7]), torch.tensor([pos]), caches[id(dense)], meta,
                                         paged_attention))
    ok &= _close("1 token, fused decode forward", quant.compute_logits(h), ref)
    ok &= check_o_quantized_in_attention(quant, caches[id(quant)], pos)
    ok &= check_parts_share_quantization(quant)
    return ok


@contextlib.contextmanager
def spied_launches(module: object, name: str, record: Callable[[Any, dict[str, Any]], object]) -> Iterator[None]:
    """While inside, each launch ``module.name[grid](*args, **kw)`` of a Triton kernel calls
    ``record(grid, kw)`` first and then launches as before; the kernel is put back after."""
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid: Any) -> Callable[..., object]:
            def launch(*args: object, **kw: Any) -> object:
                record(grid, kw)
                return kernel[grid](*args, **kw)
            return launch

    setattr(module, name, Spy())
    try:
        yield
    finally:
        setattr(module, name, kernel)


@contextlib.contextmanager
def counted_quantizations(**env: str) -> Iterator[list[object]]:
    """The dp4a GEMVs' activation quantization launches (appended to the list yielded) while the
    environment holds ``env``; both restored after."""
    import deepinfer.runtime.kernels.gguf_gemv as gguf_gemv
    from gguf_gpu_check import environment

    launches: list[object] = []
    with environment(**env), spied_launches(gguf_gemv, "_quantize_activations_kernel",
                                            lambda grid, kw: launches.append(grid)):
        yield launches


def check_parts_share_quantization(quant: torch.nn.Module) -> bool:
    """With 8-bit activations (dp4a), a projection of parts of several types (layer 0's qkv: Q4_K q
    and k, Q6_K v) quantizes its row once for all parts (with the RMSNorm, or SiLU·mul): one
    quantization launch instead of one a part, the same bits as each part quantizing it itself."""
    import deepinfer.runtime.kernels.gguf_gemv as gguf_gemv
    from deepinfer.runtime.models.gguf_linear import GGUFLinearCUDA
    from gguf_gpu_check import refuses

    qkv = quant.layers[0].qkv_proj
    assert isinstance(qkv, GGUFLinearCUDA) and len(qkv.parts) == 2, qkv
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2 * H, generator=g)
    nw = 1 + 0.1 * torch.randn(H, generator=g)
    res = torch.randn(1, qkv.out_features, generator=g)
    ok = True
    with counted_quantizations(DEEPINFER_GGUF_DP4A="1") as launches:
        for name, row, kw in (("RMSNorm", x[:, :H], {"norm": (nw, 1e-5), "residual": res}),
                              ("SiLU·mul", x, {"silu_mul": True})):
            launches.clear()
            got = qkv.gemv(row, **kw)
            shared = len(launches)
            launches.clear()
            each = torch.empty_like(got)  # every part quantizing the row itself (as before)
            for p, off in zip(qkv.parts, qkv.offsets, strict=True):
                part_kw = dict(kw)
                if "residual" in part_kw:
                    part_kw["residual"] = res[:, off:off + p.n]
                gguf_gemv.gguf_gemv(row, p, out=each[:, off:off + p.n], **part_kw)
            same = torch.equal(got, each) and shared == 1 and len(launches) == len(qkv.parts)
            print(f"{'ok  ' if same else 'FAIL'} {qkv.weight_type} qkv, {name}: {shared} quantization launch "
                  f"for {len(qkv.parts)} parts (each part alone: {len(launches)}), the same bits")
            ok &= same
        for bad, words in (({"norm": (nw[:-1], 1e-5)}, "norm weight"), ({"silu_mul": True}, "columns")):
            # checked before the shared quantization, which trusts its caller
            refused = refuses(lambda: qkv.gemv(x[:, :H], **bad), words)  # noqa: B023
            print(f"{'ok  ' if refused else 'FAIL'} {qkv.weight_type} qkv refuses {sorted(bad)} of the wrong size")
            ok &= refused
    return ok


def check_o_quantized_in_attention(quant: torch.nn.Module, caches: list[torch.Tensor], pos: int) -> bool:
    """With 8-bit activations (dp4a), ``DEEPINFER_GGUF_O_QUANT_IN_ATTENTION=1`` has the decode
    attention store the o projection's activations: one quantization launch a layer fewer, the
    same hidden states (the same codes and scales; float sums up to their order)."""
    from deepinfer.runtime.attention.triton_decode import DecodeWorkspace
    from deepinfer.runtime.models.llama_fused_decode import fused_decode_forward

    i32 = torch.int32
    hidden, counts = {}, {}
    for flag in ("0", "1"):
        with counted_quantizations(DEEPINFER_GGUF_DP4A="1", DEEPINFER_GGUF_O_QUANT_IN_ATTENTION=flag) as launches:
            hidden[flag] = fused_decode_forward(
                quant, torch.tensor([7], dtype=i32), torch.tensor([pos], dtype=i32), caches, torch.tensor([pos]),
                torch.zeros((1, 1), dtype=i32), torch.tensor([pos + 1], dtype=i32), DecodeWorkspace(2, HEADS, HD,
                                                                                                  torch.device("cpu")),
                2)
            counts[flag] = len(launches)
    fewer = counts["0"] - counts["1"]
    print(f"o activations quantized in the attention: {counts['0']} -> {counts['1']} quantization launches")
    return (fewer == L) & _close("1 token, o activations from the attention", hidden["1"], hidden["0"])


def _close(name: str, got: torch.Tensor, ref: torch.Tensor) -> bool:
    err = float((got - ref).abs().max())
    bound = 1e-4 * float(ref.abs().max())
    print(f"{'ok  ' if err <= bound else 'FAIL'} {name}: max |quantized - dense| logit {err:.3g} (bound {bound:.3g})")
    return err <= bound


def _logprob(lp: dict, token: int) -> float:  # type: ignore[type-arg]
    v = lp[token]
    return float(getattr(v, "logprob", v))  # a Logprob or a float


def check_cuda(path: str) -> bool:
    from deepinfer import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in (3, 7, 12, 20, 33, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    # the second LLM's budget (a fraction of the device, less what is in use) leaves room for the
    # first one's KV cache should the allocator still hold it
    for name, util, kw in (("quantized", 0.05, {"quantization": "gguf"}), ("dense bf16", 0.1, {"dtype": "bfloat16"})):
        llm = LLM(path, max_model_len=256, max_num_seqs=8, gpu_memory_utilization=util, **kw)
        layer = llm.worker.loaded.model.layers[0]
        print(f"{name}: {llm!r}; layer 0 qkv: {type(layer.qkv_proj).__name__} "
              f"{getattr(layer.qkv_proj, 'weight_type', '')}", flush=True)
        alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[name] = (alone, batch)
        llm.close()
        del llm, layer
        gc.collect()
        torch.cuda.empty_cache()
    same = total = 0
    for mode in (0, 1):
        for q, d in zip(runs["quantized"][mode], runs["dense bf16"][mode], strict=True):
            qt, dt = q.outputs[0].token_ids, d.outputs[0].token_ids
            total += 1
            if list(qt) == list(dt):
                same += 1
                continue
            i = next(j for j in range(len(dt)) if qt[j] != dt[j])
            lp = d.outputs[0].logprobs[i]
            gap = _logprob(lp, dt[i]) - _logprob(lp, qt[i]) if qt[i] in lp else float("inf")
            print(f"  {'batch' if mode else 'alone'}: differs at step {i}: dense logprob gap {gap:.3f}")
    print(f"greedy agreement quantized vs dequantized bf16: {same}/{total} sequences identical", flush=True)
    return True


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    path = write_mixed_gguf(os.path.join(tempfile.mkdtemp(prefix="gguf-mixed-"), "mixed.gguf"))
    if device == "cpu":  # float32 activations, which the 1e-4 bound assumes (not the 8-bit default)
        os.environ.setdefault("DEEPINFER_GGUF_DP4A", "0")
    ok = check_cpu(path) if device == "cpu" else check_cuda(path)
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

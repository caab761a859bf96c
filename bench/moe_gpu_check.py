"""Issue 30's GPU check of the MoE / MLA models (a script, not a test: run on the H200 by hand).

    python bench/moe_gpu_check.py make-refs DIR     # where transformers is installed (CPU is fine)
    python bench/moe_gpu_check.py check DIR         # on the GPU machine (torch + triton only)

``make-refs``: tiny random Mixtral / Qwen3-MoE / Qwen2-MoE / DeepSeek-V2 / DeepSeek-V3 checkpoints
(``tests/runtime/tiny_moe_models.py``) saved as config.json + a torch state dict, with
transformers' bf16 greedy tokens (16 per prompt) and its top-2 logit gap at every step.
``check``: the fused MoE kernels against a float64 per-expert reference (float32 and bf16),
our bf16 greedy tokens on CUDA against those references (whole and chunked prefill; a run that
differs is reported with transformers' gap where it differs: a near-tie or not), and the time of
one Qwen3-30B-A3B MoE layer through the fused kernels. ``DEV=cpu`` runs the model part on CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "deepinfer-meta", "src"), os.path.join(HERE, "..", "tests", "runtime")]
ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"]
PROMPTS = [list(range(3, 40)), [5, 9, 13, 100, 3, 200], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 11, 12]]
N_NEW = 16


def make_refs(out: str) -> None:
    import tempfile

    from safetensors.torch import load_file
    from tiny_moe_models import save_tiny_moe
    from transformers import AutoModelForCausalLM

    for arch in ARCHS:
        d = os.path.join(out, arch)
        os.makedirs(d, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            save_tiny_moe(tmp, arch)
            with open(os.path.join(tmp, "config.json")) as f:
                cfg = f.read()
            torch.save(load_file(os.path.join(tmp, "model.safetensors")), os.path.join(d, "weights.pt"))
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval()
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(cfg)
        refs = []
        with torch.no_grad():
            for p in PROMPTS:
                ids, gaps = list(p), []
                for _ in range(N_NEW):
                    logits = hf(torch.tensor([ids])).logits[0, -1].float()
                    top = torch.topk(logits, 2).values
                    gaps.append(float(top[0] - top[1]))
                    ids.append(int(logits.argmax()))
                refs.append(dict(prompt=p, tokens=ids[len(p):], gaps=gaps))
        with open(os.path.join(d, "ref.json"), "w") as f:
            json.dump(refs, f)
        print(arch, "references written")


def check(refs_dir: str) -> int:
    from deepinfer.runtime.loading.model_loader import LoadedModel, materialize, model_class
    from deepinfer.runtime.models.config import ModelConfig
    from deepinfer.runtime.models.rotary import RotaryEmbedding
    from deepinfer.runtime.worker.model_runner import ModelRunner
    from fused_moe_check import main as kernel_check
    from reference_driver import greedy_generate

    dev = torch.device(os.environ.get("DEV", "cuda"))
    print("GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else "none", "torch", torch.__version__)
    rc = kernel_check("cuda", "float32") | kernel_check("cuda", "bfloat16") if dev.type == "cuda" else 0
    for arch in ARCHS:
        d = os.path.join(refs_dir, arch)
        with open(os.path.join(d, "config.json")) as f:
            cfg = ModelConfig.from_hf_dict(json.load(f))
        with torch.device("meta"):
            model = model_class(cfg)(cfg, max_positions=1)
        materialize(model, dev, torch.bfloat16)
        model.load_weights(torch.load(os.path.join(d, "weights.pt")).items())
        model.rotary = RotaryEmbedding(cfg.head_dim, 256, cfg.rope_theta, cfg.rope_scaling).to(dev)
        runner = ModelRunner(LoadedModel(model=model.eval(), config=cfg, path=d), num_blocks=96, block_size=16,
                             device=dev, dtype=torch.bfloat16)
        with open(os.path.join(d, "ref.json")) as f:
            refs = json.load(f)
        for chunk in (1 << 30, 5):
            got = greedy_generate(runner, [r["prompt"] for r in refs], N_NEW, chunk=chunk)
            for i, (g, r) in enumerate(zip(got, refs, strict=True)):
                div = next((j for j in range(N_NEW) if g[j] != r["tokens"][j]), None)
                note = f"identical {N_NEW}/{N_NEW}" if div is None else (
                    f"first differs at token {div}; transformers' bf16 top-2 logit gap there {r['gaps'][div]:.4f}")
                print(f"bf16 {arch} chunk={'whole' if chunk > 99 else chunk} prompt {i} ({len(r['prompt'])} tok): {note}")
    if dev.type != "cuda":
        return rc
    from deepinfer.runtime.kernels.fused_moe import fused_experts

    w13 = torch.randn(128, 2 * 768, 2048, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(128, 2048, 768, device=dev, dtype=torch.bfloat16) * 0.02
    for t in (1, 64, 256, 2048):
        x = torch.randn(t, 2048, device=dev, dtype=torch.bfloat16)
        w = torch.rand(t, 8, device=dev).softmax(-1)
        ids = torch.stack([torch.randperm(128, device=dev)[:8] for _ in range(t)])
        for _ in range(3):
            fused_experts(x, w, ids, w13, w2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fused_experts(x, w, ids, w13, w2)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / 20 * 1e3
        flops = t * 8 * 3 * 2048 * 768 * 2
        weight_bytes = len(set(ids.flatten().tolist())) * 3 * 2048 * 768 * 2
        print(f"qwen3-30b-a3b MoE layer (fused kernels) T={t}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, "
              f"{weight_bytes / ms / 1e6:.0f} GB/s of distinct expert weights")
    return rc


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make-refs", "check"):
        sys.exit(__doc__)
    sys.exit(make_refs(sys.argv[2]) if sys.argv[1] == "make-refs" else check(sys.argv[2]))

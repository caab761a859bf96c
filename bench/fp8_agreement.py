"""What fp8 weights do to greedy decoding of a trained checkpoint (CPU, no GPU needed).

    python bench/fp8_agreement.py [--model FILE] [--prompts 20] [--tokens 48]

``quantization="fp8"`` rounds each decoder projection to E4M3 with one float32 scale per output
row (``models/fp8_linear.quantize_fp8``); ``DEEPINFER_FP8_LM_HEAD=1`` rounds the LM head the same
way. This script puts exactly those weights into the file's model (transformers, weights
dequantized by gguf to float32) and decodes greedily: for each variant, how many sequences stay
identical to the float32 run, the float32 run's logprob gap at each first divergence (a near-tie
when small), and the relative L2 error of the first step's logits. For scale, the same with every
weight rounded to bfloat16 only. The sums are float32 (the GPU kernels' order differs); the
weights are the kernels' weights. Random-weight 8B shapes amplify any perturbation (guide 08,
"FP8 weights"), so their logit errors say little; a trained model's greedy agreement says more.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gguf_act8_agreement import (  # (the same prompts, loading and greedy loop)
    PROMPTS,
    greedy,
    parse_and_load,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    from deepinfer.runtime.models.fp8_linear import dequantize_fp8, quantize_fp8

    return dequantize_fp8(*quantize_fp8(w), w.dtype)


def set_weights(model, variant: str, originals: dict[str, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    """Put the variant's weights into ``model`` (each from its float32 original)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                w = originals[name]
                module.weight.copy_(w.to(torch.bfloat16).float() if variant == "bf16" else
                                    fp8_round_trip(w) if variant.startswith("fp8") else w)
        head = originals["lm_head"]
        model.lm_head.weight.copy_(head.to(torch.bfloat16).float() if variant == "bf16" else
                                   fp8_round_trip(head) if variant == "fp8+head" else head)


def main() -> None:
    args, path, tok, model = parse_and_load(__doc__)
    # the head gets its own weight (a tied model's table stays float32 for the lookup, as in the engine)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    originals = {name: m.weight.detach().clone() for name, m in model.named_modules()
                 if name.split(".")[-1] in PROJECTIONS}
    originals["lm_head"] = model.lm_head.weight.detach().clone()
    n = min(args.prompts, len(PROMPTS))
    refs = [greedy(model, tok, prompt, args.tokens) for prompt in PROMPTS[:n]]
    variants = {"bf16": "bf16 weights", "fp8": "fp8 projections (quantization='fp8')",
                "fp8+head": "fp8 projections and LM head (DEEPINFER_FP8_LM_HEAD=1)"}
    for variant, what in variants.items():
        set_weights(model, variant, originals)
        same, gaps, errors = 0, [], []
        for prompt, (ref, lps) in zip(PROMPTS[:n], refs, strict=True):
            got, got_lps = greedy(model, tok, prompt, args.tokens)
            errors.append(float((got_lps[0].exp() - lps[0].exp()).norm() / lps[0].exp().norm()))
            if got == ref:
                same += 1
                continue
            i = next(j for j in range(len(ref)) if got[j] != ref[j])
            gaps.append(float(lps[i][ref[i]] - lps[i][got[i]]))
            print(f"  {what}: {prompt[:40]!r}: first divergence at token {i}, float32 logprob gap {gaps[-1]:.3f}",
                  flush=True)
        print(f"{what} vs float32, {os.path.basename(path)}, greedy {args.tokens} tokens: {same}/{n} sequences "
              f"identical; first step's probabilities off by {statistics.median(errors):.2%} (median relative L2)"
              + (f"; gaps at the first divergence median {statistics.median(gaps):.3f}, max {max(gaps):.3f}"
                 if gaps else ""), flush=True)
    set_weights(model, "float32", originals)


if __name__ == "__main__":
    main()

"""What 8-bit activations do to greedy decoding of a real checkpoint (CPU, no GPU needed).

    python bench/gguf_act8_agreement.py [--model FILE] [--prompts 16] [--tokens 48]

The GGUF one-row GEMV on CUDA rounds its input row to signed bytes, one scale ``amax / 127`` per
16 columns (``DEEPINFER_GGUF_DP4A=1``, the default; ``kernels/gguf_gemv.py``). This script puts
exactly that rounding in front of every projection and the LM head of the file's model
(transformers, weights dequantized by gguf to float32) and decodes greedily with and without it:
it prints how many sequences stay identical and, at each first divergence, the float32 run's
logprob gap between its token and the rounded run's (a near-tie when small). For scale, the same
with the activations rounded to bfloat16 only (what the float32-activation GPU path multiplies),
and with 32-column scales (``gguf_mmq``, batches). The float32 sums differ from the GPU kernels'
order only; the roundings are the kernels'.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis to a child.",
    "List three prime numbers greater than 100.", "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.", "Why is the sky blue?", "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?", "Describe a cat in two sentences.",
    "How do I make a cup of tea?", "Name the planets of the solar system.", "What does a CPU do?",
    "Write a short story about a robot who learns to paint.", "What are the benefits of exercise?",
    "Explain what a linked list is.", "Tell me a joke about computers.", "How does a rainbow form?",
    "What is the difference between weather and climate?",
]


def round_act8(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """The dp4a GEMV's input (``group`` 16; ``gguf_mmq``'s: 32): each ``group`` columns as signed
    bytes times ``amax / 127`` (ties to even)."""
    shape = x.shape
    t = x.float().reshape(-1, shape[-1] // group, group)
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127
    q = torch.where(amax > 0, torch.round(t * (127 / amax.clamp_min(1e-30))), torch.zeros_like(t))
    return (q * scale).reshape(shape).to(x.dtype)


def greedy(model, tok, prompt: str, n: int):  # type: ignore[no-untyped-def]
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    out, lps = [], []
    past = None
    cur = ids
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=cur, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logp = torch.log_softmax(res.logits[0, -1].double(), -1)
            t = int(logp.argmax())
            out.append(t)
            lps.append(logp)
            cur = torch.tensor([[t]])
    return out, lps


def parse_and_load(doc: str):  # type: ignore[no-untyped-def]
    """The agreement scripts' arguments (--model, --prompts, --tokens), and the file's model in
    float32 (transformers, weights dequantized by gguf) with its tokenizer: (args, path, tok, model)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.model
    if path is None:
        from deepinfer.runtime.loading.default_model import default_model_path

        path = default_model_path()
    torch.manual_seed(0)
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return args, path, tok, model


def main() -> None:
    args, path, tok, model = parse_and_load(__doc__)
    roundings = {"bf16 activations (the float32 GPU path's inputs)": lambda x: x.to(torch.bfloat16).to(x.dtype),
                 "8-bit activations, 16-column scales (the one-row dp4a GEMV)": round_act8,
                 "8-bit activations, 32-column scales (gguf_mmq, several rows)": lambda x: round_act8(x, 32)}
    n = min(args.prompts, len(PROMPTS))
    refs = [greedy(model, tok, prompt, args.tokens) for prompt in PROMPTS[:n]]
    for what, fn in roundings.items():
        hooks = [m.register_forward_pre_hook(lambda _m, inputs, fn=fn: (fn(inputs[0]),) + tuple(inputs[1:]))
                 for m in model.modules() if isinstance(m, torch.nn.Linear)]
        same, gaps = 0, []
        for prompt, (ref, lps) in zip(PROMPTS[:n], refs, strict=True):
            got, _ = greedy(model, tok, prompt, args.tokens)
            if got == ref:
                same += 1
                continue
            i = next(j for j in range(len(ref)) if got[j] != ref[j])
            gaps.append(float(lps[i][ref[i]] - lps[i][got[i]]))
            print(f"  {prompt[:40]!r}: first divergence at token {i}, float32 logprob gap {gaps[-1]:.3f}", flush=True)
        for h in hooks:
            h.remove()
        print(f"{what} vs float32, {os.path.basename(path)}, greedy {args.tokens} tokens: {same}/{n} sequences "
              "identical" + (f"; gaps at the first divergence median {statistics.median(gaps):.3f}, max "
                             f"{max(gaps):.3f}" if gaps else ""), flush=True)


if __name__ == "__main__":
    main()

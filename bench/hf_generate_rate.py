"""transformers' ``generate`` on random weights of a benchmark shape, where a whole run does not fit
the time: two short generations of the same batch give the per-step decode time, and the full run
is estimated from them (said so in the output). A script, not a test.

    python bench/hf_generate_rate.py --shape qwen3-30b-a3b --batch 256 --input-len 128 \\
        --output-len 128 --short 4,12

Prints each timed call, the decode step time ``(t(b) - t(a)) / (b - a)``, the estimated time of
``--output-len`` tokens ``t(a) + (output_len - a) * step`` and its output tok/s. Run it in its own
process after DeepInfer's (the weights of both do not fit one GPU at once).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "runtime"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--short", default="4,12", help="two short output lengths a,b (a < b)")
    args = p.parse_args()
    a, b = (int(v) for v in args.short.split(","))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from gpu_shapes import SHAPES, write_shape_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), args.shape)
    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(shape_dir)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg).eval()
    torch.set_default_dtype(torch.float32)
    print(f"== transformers {transformers.__version__} {args.shape} bf16 random weights, batch {args.batch} x "
          f"{args.input_len} in, built in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 100, (args.batch, args.input_len), generator=g).cuda()
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - start
        assert out.shape[1] - ids.shape[1] == n
        print(f"  generate {args.batch} x {n} new tokens: {dt:.2f} s", flush=True)
        return dt

    timed(a)  # warm-up
    ta, tb = timed(a), timed(b)
    step = (tb - ta) / (b - a)
    est = ta + (args.output_len - a) * step
    print(f"transformers {args.shape} b{args.batch}: decode step {step * 1e3:.1f} ms ({args.batch / step:,.0f} tok/s "
          f"in steady decode); ESTIMATED {args.batch} x ({args.input_len}, {args.output_len}): {est:.1f} s = "
          f"{args.batch * args.output_len / est:,.0f} output tok/s (from {a}- and {b}-token runs, not a whole run)",
          flush=True)


if __name__ == "__main__":
    main()

"""DeepInfer vs Hugging Face transformers ``generate`` on the same weights and prompts (CPU).

    python bench/runtime_vs_transformers.py [--new-tokens 64] [--prompt-len 64] [--concurrency 1 16]

Both load the embedded default model's GGUF (SmolLM2-135M-Instruct) in float32; both decode
greedily exactly ``--new-tokens`` tokens per prompt (EOS ignored). For concurrent requests
transformers is measured two ways: serving them one after another (``generate`` per request,
as a server without a batching engine does) and, as an upper bound it only reaches when all
prompts are known up front and have equal lengths, as one static batch. Prints output tokens/s
and the ratios; targets: >= 1x for one request, >= 3x for 16 concurrent requests.

Fairness on a shared, noisy machine: each repeat measures every contender once, in an order that
rotates from repeat to repeat (so neither side always runs first or last), and the figures are
medians over ``--repeats`` (default 3); the ratio printed is the median of the per-repeat ratios
(each from measurements taken back to back). The load average is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch


def load_transformers_gguf(path: str) -> torch.nn.Module:
    """transformers' own GGUF loading, float32, CPU (``from_pretrained`` needs accelerate; without
    it the same transformers functions are called directly)."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    folder, name = os.path.dirname(path), os.path.basename(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                    local_files_only=True).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating measurements per contender (medians are reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both (default torch's); 1 is steadier on a busy machine")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.loading.default_model import default_model_path
    path = args.model or default_model_path()
    # no prefix cache: every repeat sends the same prompts, which transformers computes anew each time
    llm = LLM(path, device="cpu", dtype="float32", enable_prefix_caching=False)
    hf = load_transformers_gguf(path)
    # EOS neither stops nor is masked on either side (DeepInfer: ignore_eos=True): exactly
    # --new-tokens tokens each, the same greedy choices.
    hf.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"threads={torch.get_num_threads()} prompt_len={args.prompt_len} new_tokens={args.new_tokens} "
          f"repeats={args.repeats} (medians) load average {os.getloadavg()[0]:.2f}", flush=True)
    for conc in args.concurrency:
        prompts = rng.integers(100, vocab - 100, size=(conc, args.prompt_len)).tolist()
        print(measure(llm, hf, prompts, params, args.new_tokens, args.repeats), flush=True)


def measure(llm, hf, prompts: list[list[int]], params, new_tokens: int, repeats: int) -> str:  # type: ignore[no-untyped-def]
    """One result line: median tok/s of each contender over ``repeats`` rotating rounds."""
    conc, prompt_len = len(prompts), len(prompts[0])
    # warm-up both
    llm.generate([{"prompt_token_ids": p} for p in prompts[:1]],
                 type(params)(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        hf.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)

    def hf_run(batch: list[list[int]]) -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(torch.tensor(batch), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, prompt_len:].tolist()

    def ours_run() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return [list(o.outputs[0].token_ids) for o in outs]

    runs = {"ours": ours_run, "seq": lambda: [hf_run([p])[0] for p in prompts]}
    if conc > 1:
        runs["batch"] = lambda: hf_run(prompts)
    times: dict[str, list[float]] = {k: [] for k in runs}
    results: dict[str, list[list[int]]] = {}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate who goes first
            t0 = time.perf_counter()
            results[name] = runs[name]()
            times[name].append(time.perf_counter() - t0)
    same = sum(o == r for o, r in zip(results["ours"], results["seq"], strict=True))
    n = conc * new_tokens

    def tps(name: str) -> float:
        return n / statistics.median(times[name])

    def ratio(name: str) -> float:  # median of the per-round ratios (measured back to back)
        return statistics.median(b / a for a, b in zip(times["ours"], times[name], strict=True))

    line = (f"concurrency {conc:3d}: deepinfer {tps('ours'):7.1f} tok/s | transformers one-by-one "
            f"{tps('seq'):7.1f} tok/s -> ratio {ratio('seq'):5.2f}x")
    if "batch" in runs:
        line += f" | transformers static batch {tps('batch'):7.1f} tok/s -> ratio {ratio('batch'):5.2f}x"
    per = " ".join(f"{b / a:.2f}" for a, b in zip(times["ours"], times["seq"], strict=True))
    return (line + f" | identical greedy outputs {same}/{conc} | per-round ratios {per} "
            f"| load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""DeepInfer vs Hugging Face transformers ``generate`` on the same weights and prompts (CPU).

    python bench/runtime_vs_transformers.py [--new-tokens 64] [--prompt-len 64] [--concurrency 1 16]

Both load the embedded default model's GGUF (SmolLM2-135M-Instruct) in float32; both decode
greedily exactly ``--new-tokens`` tokens per prompt (EOS ignored). For concurrent requests
transformers is measured two ways: serving them one after another (``generate`` per request,
as a server without a batching engine does) and, as an upper bound it only reaches when all
prompts are known up front and have equal lengths, as one static batch. Prints output tokens/s
and the ratios; targets: >= 1x for one request, >= 3x for 16 concurrent requests.
"""

from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.default_model import default_model_path
    path = args.model or default_model_path()
    llm = LLM(path, device="cpu", dtype="float32")
    hf = load_transformers_gguf(path)
    # EOS neither stops nor is masked on either side (DeepInfer: ignore_eos=True): exactly
    # --new-tokens tokens each, the same greedy choices.
    hf.generation_config.eos_token_id = None
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    print(f"threads={torch.get_num_threads()} prompt_len={args.prompt_len} new_tokens={args.new_tokens}")
    for conc in args.concurrency:
        prompts = rng.integers(100, vocab - 100, size=(conc, args.prompt_len)).tolist()
        # warm-up both
        llm.generate([{"prompt_token_ids": p} for p in prompts[:1]],
                     SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        with torch.no_grad():
            hf.generate(torch.tensor(prompts[:1]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        def hf_run(batch):
            with torch.no_grad():
                out = hf.generate(torch.tensor(batch), max_new_tokens=args.new_tokens, do_sample=False,
                                  pad_token_id=0)
            return out[:, args.prompt_len:].tolist()

        ours_t, seq_t, batch_t = [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            ours_t.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
            t0 = time.perf_counter()
            ref = [hf_run([p])[0] for p in prompts]
            seq_t.append(time.perf_counter() - t0)
            if conc > 1:
                t0 = time.perf_counter()
                hf_run(prompts)
                batch_t.append(time.perf_counter() - t0)
        same = sum(list(o.outputs[0].token_ids) == r for o, r in zip(outs, ref, strict=True))
        n = conc * args.new_tokens
        ours_tps, seq_tps = n / min(ours_t), n / min(seq_t)
        line = (f"concurrency {conc:3d}: deepinfer {ours_tps:7.1f} tok/s | transformers one-by-one {seq_tps:7.1f} "
                f"tok/s -> ratio {ours_tps / seq_tps:5.2f}x")
        if batch_t:
            batch_tps = n / min(batch_t)
            line += f" | transformers static batch {batch_tps:7.1f} tok/s -> ratio {ours_tps / batch_tps:5.2f}x"
        print(line + f" | identical greedy outputs {same}/{conc}")


if __name__ == "__main__":
    main()

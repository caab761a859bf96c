"""CUDA check of the runtime: greedy parity with transformers (float32, TF32 off) and throughput.

    python bench/runtime_cuda_check.py --shape-dir DIR [--tokens 16] [--num-prompts 256]

DIR holds a config.json (and tokenizer files) of a Llama-family model, e.g. SmolLM2-135M's;
the weights are random (seeded), saved as safetensors so that transformers and DeepInfer load
the very same tensors. Parity: prompts of different lengths in one batch, through the engine
with chunked prefill small enough to split prompts and prefix caching on (shared prefix), for
each attention backend; compares token ids and one step's logits. Throughput: bfloat16,
``--num-prompts`` random prompts, prints requests/s and tokens/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape-dir", required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu for a dry run")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    from deepinfer import LLM, SamplingParams
    from transformers import AutoConfig, LlamaForCausalLM

    work = tempfile.mkdtemp(prefix="deepinfer-cuda-")
    for f in os.listdir(args.shape_dir):
        shutil.copy(os.path.join(args.shape_dir, f), work)
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(work)
    cfg.initializer_range = 0.05  # livelier than 0.02: random models otherwise repeat one token
    hf = LlamaForCausalLM(cfg).float()
    hf.save_pretrained(work)
    hf = hf.to(args.device).eval()
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {name} torch {torch.__version__}; random weights of {cfg.model_type} "
          f"hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} heads={cfg.num_attention_heads}/"
          f"{cfg.num_key_value_heads}")

    rng = np.random.default_rng(0)
    shared = rng.integers(100, cfg.vocab_size - 100, 40).tolist()
    prompts = [shared + rng.integers(100, cfg.vocab_size - 100, n).tolist() for n in (3, 17, 60)]
    prompts += [rng.integers(100, cfg.vocab_size - 100, n).tolist() for n in (1, 9, 33, 130)]
    ref = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=args.device), max_new_tokens=args.tokens,
                              min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
            ref.append(out[0, len(p):].tolist())
        ref_logits = hf(torch.tensor([prompts[-1]], device=args.device)).logits[0, -1].float()
    distinct = len({t for r in ref for t in r})
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    backends = ("triton", "torch") if args.device.startswith("cuda") else ("torch",)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for backend in backends:
        llm = LLM(work, device=args.device, dtype="float32", attention_backend=backend, max_model_len=512,
                  max_num_batched_tokens=64, num_kv_blocks=256)
        for rnd in range(2):  # the second round is served from the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            same = sum(list(o.outputs[0].token_ids) == r for o, r in zip(outs, ref, strict=True))
            cached = [o.metrics["num_cached_tokens"] for o in outs]
            print(f"parity float32 backend={backend} round={rnd}: identical greedy outputs {same}/{len(prompts)} "
                  f"({args.tokens} tokens each, {distinct} distinct reference tokens); cached tokens {cached}")
        runner = llm.runner
        n = len(prompts[-1])
        logits = runner.execute(input_ids=np.array(prompts[-1]), positions=np.arange(n),
                                slot_mapping=np.arange(n) + 16 * 200, query_start_loc=np.array([0, n]),
                                seq_lens=np.array([n]), block_tables=np.arange(200, 200 + (n + 15) // 16)[None],
                                logits_indices=np.array([n - 1]))
        print(f"  last-position logits max |diff| vs transformers: {(logits[0] - ref_logits).abs().max().item():.2e}")
        del llm
        torch.cuda.empty_cache()

    del hf
    torch.cuda.empty_cache()
    for backend in backends:
        llm = LLM(work, device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32", attention_backend=backend, max_num_seqs=256,
                  max_num_batched_tokens=8192, max_model_len=2048, gpu_memory_utilization=0.5)
        toks = [{"prompt_token_ids": rng.integers(100, cfg.vocab_size - 100, args.input_len).tolist()}
                for _ in range(args.num_prompts)]
        tp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(toks[:8], tp, use_tqdm=False)
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(toks, tp, use_tqdm=False)
        sync()
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"throughput bf16 backend={backend}: {len(outs)} requests x ({args.input_len} in, {args.output_len} out) "
              f"in {dt:.2f} s: {len(outs) / dt:.1f} req/s, {len(outs) * args.input_len / dt:.0f} input tok/s, "
              f"{n_out / dt:.0f} output tok/s; {llm.engine.num_steps} steps")
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

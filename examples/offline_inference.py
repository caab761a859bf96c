"""Offline inference with DeepInfer's embedded default model (SmolLM2-135M-Instruct) on CPU.

    python examples/offline_inference.py [--device cpu] [--max-tokens 48]

Runs a few chat prompts through ``deepinfer.LLM`` in one batch and prints each prompt, its
completion and the throughput.
"""

from __future__ import annotations

import argparse
import time

from deepinfer import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "Give three tips for learning a new language.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    print(f"Loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} on {args.device} ...", flush=True)
    start = time.perf_counter()
    llm = LLM(args.model, device=args.device)
    print(f"Loaded in {time.perf_counter() - start:.1f} s; answering {len(QUESTIONS)} questions in one batch ...\n",
          flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # greedy
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]

    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    generated = 0
    for question, out in zip(QUESTIONS, outputs, strict=True):
        completion = out.outputs[0]
        generated += len(completion.token_ids)
        print(f"Prompt:     {question!r}")
        print(f"Completion: {completion.text.strip()!r}  ({completion.finish_reason})\n")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"{len(outputs)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} output tok/s ({llm.device}, {llm.precision()})")


if __name__ == "__main__":
    main()

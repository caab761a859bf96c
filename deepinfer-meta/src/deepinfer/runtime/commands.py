"""The runtime's subcommands of ``deepinfer``: ``generate``, ``chat`` and ``bench``.

Importing this module is cheap (no torch): the LLM loads when a command runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of requests without --sample-seed")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("-n", type=int, default=1, help="samples per prompt")


def _sampling_params(args: argparse.Namespace) -> Any:
    from deepinfer.runtime.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
        ignore_eos=args.ignore_eos, max_tokens=args.max_tokens, min_tokens=args.min_tokens)


def _llm(args: argparse.Namespace) -> Any:
    from deepinfer.runtime.llm import LLM

    return LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               seed=args.seed)


def _run_guarded(fn: Any, args: argparse.Namespace) -> int:
    try:
        return int(fn(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"deepinfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
    if args.no_stream or params.n > 1:
        for ro in llm.generate(args.prompt, params, use_tqdm=False):
            for c in ro.outputs:
                print(c.text)
        return 0
    for ro in llm.stream(args.prompt, params):
        for c in ro.outputs:
            sys.stdout.write(c.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    lines = [args.message] if args.message else None
    while True:
        if lines is not None:
            if not lines:
                return 0
            user = lines.pop(0)
        else:
            try:
                user = input("you> ")
            except EOFError:
                return 0
        if user.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": user})
        reply = ""
        sys.stdout.write("assistant> ")
        for ro in llm.stream(llm.apply_chat_template(messages), params):
            for c in ro.outputs:
                reply += c.text
                sys.stdout.write(c.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def _bench(args: argparse.Namespace) -> int:
    import numpy as np

    from deepinfer.runtime.llm import LLM
    from deepinfer.runtime.sampling_params import SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=args.seed, dummy_weights=args.dummy_weights)
    rng = np.random.default_rng(args.seed)
    vocab = llm.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    dt = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"{len(outs)} requests in {dt:.2f} s: {len(outs) / dt:.2f} requests/s, "
          f"{n_in / dt:.1f} input tok/s, {n_out / dt:.1f} output tok/s, {(n_in + n_out) / dt:.1f} total tok/s "
          f"(device {llm.device}, dtype {str(llm.dtype).replace('torch.', '')})")
    return 0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Options of the offline throughput benchmark (shared with examples/benchmark.py)."""
    _model_args(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dummy-weights", action="store_true", help="random weights of the model's shape")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_bench(args: argparse.Namespace) -> int:
    """Run the offline throughput benchmark with parsed ``add_bench_args`` options."""
    return _bench(args)


def register(subparsers: Any) -> None:
    """Add ``generate``, ``chat`` and ``bench`` to the ``deepinfer`` command's subparsers."""
    g = subparsers.add_parser("generate", help="complete a prompt (streams to stdout)")
    g.add_argument("prompt")
    g.add_argument("--no-stream", action="store_true", help="print the completion when done")
    _model_args(g)
    _sampling_args(g)
    g.set_defaults(func=lambda a: _run_guarded(_generate, a))

    c = subparsers.add_parser("chat", help="chat with the model (chat template applied)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--message", default=None, help="one user message, then exit (no prompt)")
    _model_args(c)
    _sampling_args(c)
    c.set_defaults(func=lambda a: _run_guarded(_chat, a))

    b = subparsers.add_parser("bench", help="offline throughput on random prompts")
    add_bench_args(b)
    b.set_defaults(func=lambda a: _run_guarded(_bench, a))

    from deepinfer.serve.cli import register as register_serve
    register_serve(subparsers)

"""The runtime's subcommands of ``deepinfer``: generate, chat and bench (one register_* each).

Importing this module is cheap (no torch): the LLM loads when a command runs. Bad input of any
command (an invalid option value, a prompt longer than the context, a missing model file) is
one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from deepinfer.cli.console import deferred_interrupt, status

EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# ---- options shared by the subcommands --------------------------------------------------------
def _model_args(p: argparse.ArgumentParser) -> None:
    """The model and engine options: one per ``EngineArgs`` field (``serve`` takes the same)."""
    from deepinfer.runtime.engine_args import EngineArgs

    EngineArgs.add_cli_args(p)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=_positive_int, metavar="N", default=max_tokens, help="tokens to generate at most")
    p.add_argument("--min-tokens", type=int, metavar="N", default=0, help="tokens to generate before EOS or a stop may end it")
    p.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, metavar="P", default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, metavar="K", default=-1, help="-1 keeps every token")
    p.add_argument("--min-p", type=float, metavar="P", default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--presence-penalty", type=float, metavar="X", default=0.0, help="penalty of tokens already present")
    p.add_argument("--frequency-penalty", type=float, metavar="X", default=0.0, help="penalty per earlier occurrence")
    p.add_argument("--repetition-penalty", type=float, metavar="X", default=1.0, help="1 is none")
    p.add_argument("--sample-seed", type=int, metavar="N", default=None, help="per-request seed (default: from --seed)")
    p.add_argument("--stop", action="append", metavar="TEXT", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")


def _sampling_params(args: argparse.Namespace) -> Any:
    from deepinfer.runtime.sampling_params import SamplingParams

    return SamplingParams(
        n=getattr(args, "n", 1), temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens)


def _llm(args: argparse.Namespace) -> Any:
    """The LLM of the command's model and engine options, with a status line while it loads."""
    from deepinfer.runtime.engine_args import EngineArgs

    options = EngineArgs.from_cli_args(args).to_kwargs()  # bad combinations fail before loading
    name = os.path.basename(os.path.normpath(args.model)) if args.model else "the default model"
    with status(f"loading {name}"):
        from deepinfer.runtime.llm import LLM

        return LLM(**options)


def context_len(llm: Any) -> int:
    """The LLM's context length (prompt + completion tokens)."""
    return int(llm.engine.cfg.max_model_len)


def _prompt_ids(llm: Any, prompt: str) -> list[int]:
    """Token ids of ``prompt``; ValueError with both counts when it leaves no room to generate."""
    ids = list(llm.text_tokenizer(prompt).input_ids)
    limit = context_len(llm)
    if len(ids) >= limit:
        raise ValueError(f"the prompt is {len(ids)} tokens but the context holds {limit} "
                         f"(prompt + completion; --max-model-len): shorten the prompt")
    return ids


def _run_guarded(fn: Any, args: argparse.Namespace) -> int:
    """Run a command; bad input is one line on stderr and exit status 2."""
    try:
        return int(fn(args) or 0)
    except BrokenPipeError:
        raise
    except (ValueError, TypeError, OSError) as exc:
        message = " ".join(str(exc).split())
        print(f"deepinfer {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


# ---- generate ---------------------------------------------------------------------------------
def _generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)  # bad values fail before the model loads
    llm = _llm(args)
    prompt = {"prompt_token_ids": _prompt_ids(llm, args.prompt)}
    out = sys.stdout
    room = context_len(llm) - len(prompt["prompt_token_ids"])
    if args.no_stream or params.n > 1:
        outputs = llm.generate(prompt, params, use_tqdm=False)  # Ctrl-C: raised at once, exit 130
        completions = outputs[0].outputs
        for c in completions:
            if len(completions) > 1:
                out.write(f"--- completion {c.index + 1} of {len(completions)} ---\n")
            out.write(c.text + "\n")
        out.flush()
        if any(_cut_by_context(c.finish_reason, len(c.token_ids), room, params.max_tokens) for c in completions):
            _context_note(llm, room)
        return 0
    stream = llm.stream(prompt, params)
    generated, reason = 0, None
    with deferred_interrupt() as ctrl_c:  # Ctrl-C ends the stream between two engine steps
        try:
            for delta in stream:
                for c in delta.outputs:
                    generated += len(c.token_ids)
                    reason = c.finish_reason or reason
                out.write(delta.outputs[0].text if delta.outputs else "")
                out.flush()
                if ctrl_c.requested:
                    break
        finally:
            stream.close()
            out.write("\n")
            out.flush()
    if ctrl_c.requested:
        raise KeyboardInterrupt
    if _cut_by_context(reason, generated, room, params.max_tokens):
        _context_note(llm, room)
    return 0


def _cut_by_context(finish_reason: str | None, generated: int, room: int, max_tokens: int | None) -> bool:
    """Whether a completion ended because the context was full, before its --max-tokens."""
    return finish_reason == "length" and generated >= room and (max_tokens is None or generated < max_tokens)


def _context_note(llm: Any, room: int) -> None:
    print(f"deepinfer generate: stopped at the context limit ({context_len(llm)} tokens, --max-model-len): the "
          f"prompt left room for {room} tokens", file=sys.stderr)


def register_generate(subparsers: Any) -> argparse.ArgumentParser:
    g = subparsers.add_parser(
        "generate", help="complete a prompt (streams to stdout)",
        description="Complete PROMPT with the model and print the completion (greedy by default).")
    g.add_argument("prompt", help="the text to complete")
    g.add_argument("--no-stream", action="store_true", help="print the completion when done")
    g.add_argument("-n", type=_positive_int, default=1, help="completions of the prompt (separated by a line)")
    _model_args(g)
    _sampling_args(g)
    g.set_defaults(func=lambda a: _run_guarded(_generate, a))
    return g


# ---- chat -------------------------------------------------------------------------------------
def _chat(args: argparse.Namespace) -> int:
    from deepinfer.cli.chat_repl import ChatSession, run_chat

    params = _sampling_params(args)
    llm = _llm(args)
    if not getattr(llm.text_tokenizer, "chat_template", None):
        raise ValueError(f"the model at {llm.model_path!r} has no chat template: use deepinfer generate")
    session = ChatSession(llm, params, context_len(llm), system=args.system)
    return run_chat(session, once=args.message)


def register_chat(subparsers: Any) -> argparse.ArgumentParser:
    c = subparsers.add_parser(
        "chat", help="chat with the model (chat template applied)",
        description="Chat with the model. In the terminal: line editing and history, Ctrl-C stops "
                    "a reply, /reset starts over, /exit or Ctrl-D quits. The oldest turns are "
                    "dropped when the conversation outgrows the context.")
    c.add_argument("--system", default=None, metavar="TEXT", help="system prompt (default: none)")
    c.add_argument("--message", action="append", metavar="TEXT", default=None,
                   help="a user message to answer, then exit without prompting (repeatable: "
                        "one conversation)")
    _model_args(c)
    _sampling_args(c, max_tokens=256)
    c.set_defaults(func=lambda a: _run_guarded(_chat, a))
    return c


# ---- bench ------------------------------------------------------------------------------------
def _machine_note(llm: Any) -> str:
    """What a figure depends on: backend, device, dtype, threads and the load on the machine."""
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"backend {llm.backend}, device {llm.device}, {llm.precision()}, "
            f"threads {torch.get_num_threads()}, load average {load:.2f} on {os.cpu_count()} CPUs")


def _kernel_paths(llm: Any) -> list[str]:
    """Weight type, activations and kernel path per tensor kind (worker.native_decode.kernel_paths)."""
    from deepinfer.runtime.worker.native_decode import kernel_paths

    runner = getattr(llm, "runner", None)
    return kernel_paths(getattr(runner, "model", None), getattr(runner, "native_decode", None))


def _bench(args: argparse.Namespace) -> int:
    import numpy as np

    from deepinfer.runtime.bench_metrics import measure_generate, runs_summary
    from deepinfer.runtime.sampling_params import SamplingParams

    oracle = getattr(args, "speculative_oracle", False)
    if oracle:  # drafts from a recorded greedy run (the method "oracle"), k from --speculative-config
        from deepinfer.runtime.speculative.config import parse_speculative_config

        given = parse_speculative_config(args.speculative_config)
        if given is None or given.method != "draft_model":  # a draft model still runs: its cost is measured
            args.speculative_config = {"method": "oracle",
                                       "num_speculative_tokens": given.num_speculative_tokens if given else 4}
    llm = _llm(args)
    limit = context_len(llm)
    if args.input_len + args.output_len > limit:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} tokens do not "
                         f"fit the context of {limit} tokens (--max-model-len)")
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(args.seed)
    low, high = min(100, vocab // 4), max(vocab - 100, vocab // 4 + 1)  # avoid special tokens

    def fresh_prompts() -> list[dict[str, list[int]]]:  # new ones each run: no prefix-cache hits
        return [{"prompt_token_ids": rng.integers(low, high, args.input_len).tolist()}
                for _ in range(args.num_prompts)]

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # Warm up at the measured shapes (the same batch, prompt and output lengths): the timed runs
    # must not pay first-use costs (kernel selection, compilation, allocator growth).
    llm.generate(fresh_prompts(), params, use_tqdm=False)
    note = _machine_note(llm)
    print("what runs, per tensor kind:")
    for line in _kernel_paths(llm):
        print(f"  {line}")
    rates = []
    for run in range(args.runs):
        prompts = fresh_prompts()
        if oracle:  # the recorded greedy run of these prompts (no drafts yet: plain decoding)
            for req, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
                llm.engine.speculator.record_oracle(req["prompt_token_ids"], list(out.outputs[0].token_ids))
        report = measure_generate(llm, prompts, params, use_tqdm=not args.quiet,
                                  profile=args.profile and run == args.runs - 1)
        rates.append(report.output_tok_s)
        if args.runs > 1:
            print(f"run {run + 1} of {args.runs}:")
        for line in report.lines():  # each figure with what it depends on (not the region table)
            print(line if line.startswith(" ") or line.endswith(":") else f"{line} [{note}]")
    if args.runs > 1:
        print(f"{runs_summary('bench', rates)} [{note}]")
    return 0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Options of the offline throughput benchmark (shared with examples/benchmark.py)."""
    _model_args(p)
    p.add_argument("--num-prompts", type=_positive_int, metavar="N", default=32, help="requests in the batch")
    p.add_argument("--input-len", type=_positive_int, metavar="N", default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=_positive_int, metavar="N", default=64, help="generated tokens per request")
    p.add_argument("--runs", type=_positive_int, metavar="N", default=1,
                   help="timed runs after the warm-up (each on fresh prompts); with more than one, the "
                        "median output tok/s and its spread are printed as bench/gpu_bench.py prints them")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--profile", action="store_true", help="GraphTimer region times inside the decode graphs")
    p.add_argument("--speculative-oracle", action="store_true",
                   help="speculative decoding with drafts from a recorded greedy run of the same prompts "
                        "(every draft kept, drafting free): the verification path's ceiling; k from "
                        "--speculative-config (default 4). With a draft model in --speculative-config the "
                        "draft model still drafts every step (its cost per step is printed) but the "
                        "recorded drafts are verified")


def run_bench(args: argparse.Namespace) -> int:
    """Run the offline throughput benchmark with parsed ``add_bench_args`` options."""
    args.command = getattr(args, "command", None) or "bench"
    return _run_guarded(_bench, args)


def register_bench(subparsers: Any) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench", help="offline throughput on random prompts",
        description="Offline throughput of --num-prompts random prompts of --input-len tokens, each "
                    "generating --output-len tokens (greedy, EOS ignored).")
    add_bench_args(b)
    b.set_defaults(func=run_bench)
    return b


# ---- registration -----------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    """Add the runtime's subcommands to the ``deepinfer`` command's subparsers."""
    register_generate(subparsers)
    register_chat(subparsers)
    register_bench(subparsers)

    from deepinfer.cli.serve import register as register_serve

    register_serve(subparsers)

"""Engine-core CPU per streamed output token, without a device, a socket or HTTP (issue 25).

Runs the ``deepinfer serve`` engine core's loop (``serve.core.CoreEngine``: the step loop, the
per-step deltas, the metric events, msgpack encoding of each step's message) over a tiny random
Llama on the CPU, with a fake ROUTER socket (it decodes nothing and counts the bytes sent), and
``LLM.generate`` on the same requests for comparison. Both do the same model work, so the
difference is what serving costs beyond the engine: the figure the core's serial CPU time per
token adds to every decode step on a GPU.

    python bench/serve_core_cpu.py [--requests 256] [--tokens 32] [--runs 3] [--json]

Reports, per measured run, process CPU time (user + system, all threads) per output token of
the core loop and of ``generate``; prints the median of ``--runs`` runs of each. The machine
this was written on is shared: compare builds by running them interleaved in separate
processes (e.g. ``for i in 1..N: PYTHONPATH=A ...; PYTHONPATH=B ...``) and compare medians.

``--profile FILE``: cProfile the core loop of one run into FILE (pstats) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def save_tiny_llama(path: str, vocab: int = 320) -> None:
    """A tiny random Llama with a word-level tokenizer ("t0".."tN") saved in ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            rope_theta=50000.0,
            tie_word_embeddings=False,
        )
    )
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(path)


class FakeRouter:
    """What CoreEngine sends to: counts messages and bytes."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        self.messages += 1
        self.bytes += len(parts[1])


class Commands:
    """The adds first, then ``stop`` once the loop waits for a command (every request done)."""

    def __init__(self, commands: list[tuple[Any, ...]]) -> None:
        self._commands = list(commands)

    def get(self) -> tuple[Any, ...]:
        return self._commands.pop(0) if self._commands else ("stop",)

    def get_nowait(self) -> tuple[Any, ...]:
        if not self._commands:
            raise queue.Empty
        return self._commands.pop(0)


def requests(n: int, tokens: int, vocab: int = 320) -> list[tuple[list[int], Any]]:
    import random

    from deepinfer.runtime.sampling_params import SamplingParams

    rng = random.Random(0)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))],
            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, detokenize=False),
        )
        for _ in range(n)
    ]


def run_core(
    llm: Any, reqs: list[tuple[list[int], Any]], profile: str | None = None
) -> tuple[float, int]:
    """CPU seconds of one CoreEngine run over ``reqs`` and the output tokens it sent."""
    from deepinfer.serve.core import CoreEngine

    sock = FakeRouter()
    core = CoreEngine(llm, sock, {}, os.getppid())
    core.frontends[b"fe"] = os.getpid()
    now = time.monotonic()
    core._commands = Commands(
        [
            ("add", f"r{i}", p, sp, (b"fe", f"r{i}"), 0, now, None)  # type: ignore[assignment]
            for i, (p, sp) in enumerate(reqs)
        ]
    )
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.process_time()
    core.run()
    cpu = time.process_time() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    if core.error is not None:
        raise core.error
    return cpu, sum(sp.max_tokens for _, sp in reqs)


def run_generate(llm: Any, reqs: list[tuple[list[int], Any]]) -> tuple[float, int]:
    t0 = time.process_time()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False
    )
    cpu = time.process_time() - t0
    return cpu, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line with every run's figures")
    ap.add_argument("--profile", help="cProfile one core run into this file")
    args = ap.parse_args()
    from deepinfer.runtime.llm import LLM

    with tempfile.TemporaryDirectory() as d:
        save_tiny_llama(d)
        llm = LLM(
            d,
            device="cpu",
            dtype="float32",
            max_num_seqs=args.requests,
            max_model_len=256,
            cpu_kv_cache_bytes=64 << 20,
        )
        reqs = requests(args.requests, args.tokens)
        run_core(llm, reqs)  # warm-up of both paths
        run_generate(llm, reqs)
        if args.profile:
            run_core(llm, reqs, profile=args.profile)
            return 0
        core_us, gen_us = [], []
        for _ in range(args.runs):
            cpu, toks = run_core(llm, reqs)
            core_us.append(1e6 * cpu / toks)
            cpu, toks = run_generate(llm, reqs)
            gen_us.append(1e6 * cpu / toks)
    diff = [c - g for c, g in zip(core_us, gen_us, strict=True)]
    if args.json:
        print(json.dumps({"core_us": core_us, "generate_us": gen_us, "diff_us": diff}))
    else:
        print(f"core CPU per output token     {statistics.median(core_us):6.2f} us  runs {core_us}")
        print(f"generate CPU per output token {statistics.median(gen_us):6.2f} us  runs {gen_us}")
        print(f"core minus generate           {statistics.median(diff):6.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

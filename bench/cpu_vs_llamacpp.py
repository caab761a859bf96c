"""DeepInfer vs llama.cpp vs transformers on the same GGUF file, CPU, interleaved rounds.

    python bench/cpu_vs_llamacpp.py [--model FILE] [--quantize Q4_K_M] [--rounds 3] [--repeats 1] [--threads 2]
                                    [--only dq df lq lf tf]

Contenders (all greedy, EOS ignored, ``--threads`` intra-op threads each):
  lq  llama.cpp (``llama-cpp-python``, low-level API) on the file as shipped (Q4_1 + Q8_0; with
      ``--quantize Q4_K_M``, the copy llama.cpp's quantize tool made, which every contender runs)
  lf  llama.cpp on the same weights in F32 (a copy made once with llama.cpp's own quantize tool
      into ``$TMPDIR``)
  dq  DeepInfer default on CPU: the file's quantization kept (int4 kernels)
  df  DeepInfer ``dtype="float32"`` (dequantized)
  tf  transformers float32 (its own GGUF loader)
Measures: load (construct the model from the file), batch-1 decode (64-token prompt, 128 new:
new tokens / wall time), a 512-token prompt (prompt tokens / time to the first token),
16 concurrent requests of 64 + 64 (total new tokens / wall time; llama.cpp decodes them as 16
sequences of one batch, its "parallel slots"; transformers as one static batch).

Every round loads and measures each contender once, in an order that rotates from round to
round; each figure is printed with the 1-minute load average when it was taken, and the ratios
DeepInfer / llama.cpp are per round (taken minutes apart at most). ``--repeats N``: each
figure of a round (but load) is the median of N runs after the warm-up, which smooths a
machine whose speed moves within seconds (a VM whose host is shared). llama.cpp is skipped, with
the reason, when ``llama_cpp`` does not import. The machine this runs on may be shared: read the
load averages before the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

PROMPT_LEN, NEW_TOKENS, LONG_PROMPT, CONC, CONC_NEW = 64, 128, 512, 16, 64


def load_avg() -> float:
    return os.getloadavg()[0]


# ---- llama.cpp through llama-cpp-python's ctypes API ---------------------------------------------
def _no_log(level: int, text: bytes, user_data: Any) -> None:
    pass


try:  # llama.cpp's per-load log lines would drown the figures
    import llama_cpp as _lc

    _QUIET = _lc.llama_log_callback(_no_log)
except ImportError:
    _QUIET = None


class LlamaCpp:
    """One llama.cpp model + context; ``run`` decodes sequences in one batch with greedy picks."""

    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_log_set(_QUIET, None)
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, max(n_ctx, 512), 512, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False  # a KV stream per sequence (n_ctx / n_seq cells each), as llama-server's slots
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(n_ctx, 512), 0, n_seq)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, pos, seq, wants_logits); returns the greedy token of each logits row."""
        b, picks = self.batch, []
        b.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, want
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        for i, (_, _, _, want) in enumerate(items):
            if want:
                ptr = self.lc.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
                picks.append(int(row.argmax()))
        return picks

    def run(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Seconds to prefill all prompts (one batch; chunks of 512 tokens) and decode ``new_tokens`` each."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t = time.perf_counter()
        items = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        last: list[int] = []
        for start in range(0, len(items), 512):
            last += self._decode(items[start:start + 512])
        lens = [len(p) for p in prompts]
        for step in range(new_tokens - 1):
            last = self._decode([(tok, lens[s] + step, s, True) for s, tok in enumerate(last)])
        return time.perf_counter() - t


def llama_copy(path: str, ftype: str, threads: int) -> str:
    """The GGUF's weights re-quantized to llama.cpp file type ``ftype`` (``F32``, ``Q4_K_M``,
    ``Q8_0``, ...: ``LLAMA_FTYPE_MOSTLY_<ftype>`` / ``LLAMA_FTYPE_ALL_F32``), written once by
    llama.cpp's own quantize tool (cached in $TMPDIR)."""
    import llama_cpp as lc

    code = getattr(lc, "LLAMA_FTYPE_ALL_F32" if ftype == "F32" else f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if code is None:
        raise ValueError(f"--quantize {ftype}: not a llama.cpp file type (e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0)")
    out = os.path.join(tempfile.gettempdir(), os.path.basename(path).replace(".gguf", f".{ftype}.gguf"))
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(path):
        lc.llama_log_set(_QUIET, None)  # a line per tensor otherwise
        params = lc.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = code, True, threads
        if lc.llama_model_quantize(path.encode(), (out + ".tmp").encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize to {ftype} failed")
        os.replace(out + ".tmp", out)
    return out


def f32_copy(path: str, threads: int) -> str:
    """The GGUF's weights in F32 (see ``llama_copy``)."""
    return llama_copy(path, "F32", threads)


# ---- contenders -------------------------------------------------------------------------------
class Contender:
    """load() returns seconds; the three measures return tokens/s, each from ``_gen``: the seconds
    a contender takes to prefill ``prompts`` and generate ``n`` tokens for each."""

    def __init__(self, name: str) -> None:
        self.name = name

    def load(self) -> float:
        raise NotImplementedError

    def _gen(self, prompts: list[list[int]], n: int) -> float:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def decode1(self, prompt: list[int]) -> float:
        return NEW_TOKENS / self._gen([prompt], NEW_TOKENS)

    def long_prompt(self, prompt: list[int]) -> float:
        return len(prompt) / self._gen([prompt], 1)

    def concurrent(self, prompts: list[list[int]]) -> float:
        return len(prompts) * CONC_NEW / self._gen(prompts, CONC_NEW)


class LlamaCppContender(Contender):
    def __init__(self, name: str, path: str, threads: int) -> None:
        super().__init__(name)
        self.path, self.threads = path, threads
        self.ll: LlamaCpp | None = None

    def load(self) -> float:
        t = time.perf_counter()
        self.ll = LlamaCpp(self.path, self.threads, n_ctx=CONC * (LONG_PROMPT + NEW_TOKENS), n_seq=CONC)
        return time.perf_counter() - t

    def _gen(self, prompts: list[list[int]], n: int) -> float:
        assert self.ll is not None
        return self.ll.run(prompts, n)

    def close(self) -> None:
        if self.ll is not None:
            self.ll.close()
            self.ll = None


class DeepInferContender(Contender):
    def __init__(self, name: str, path: str, dtype: str | None) -> None:
        super().__init__(name)
        self.path, self.dtype = path, dtype
        self.llm: Any = None

    def load(self) -> float:
        from deepinfer import LLM

        t = time.perf_counter()
        # no prefix caching: the warm-up run's prompt must not be served from the cache
        self.llm = LLM(self.path, device="cpu", dtype=self.dtype, max_model_len=1024, enable_prefix_caching=False)
        return time.perf_counter() - t

    def _gen(self, prompts: list[list[int]], n: int) -> float:
        from deepinfer import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    def close(self) -> None:
        self.llm = None


class TransformersContender(Contender):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        self.path = path
        self.model: Any = None

    def load(self) -> float:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from runtime_vs_transformers import load_transformers_gguf

        t = time.perf_counter()
        self.model = load_transformers_gguf(self.path)
        self.model.generation_config.eos_token_id = None
        return time.perf_counter() - t

    def _gen(self, prompts: list[list[int]], n: int) -> float:
        import torch

        t = time.perf_counter()
        with torch.no_grad():
            self.model.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
        return time.perf_counter() - t

    def close(self) -> None:
        self.model = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    parser.add_argument("--quantize", default=None, metavar="FTYPE",
                        help="bench a copy of --model re-quantized by llama.cpp's quantize tool to this file "
                             "type (e.g. Q4_K_M; cached in $TMPDIR): every contender runs that file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per figure of a round (median), load excepted")
    parser.add_argument("--only", nargs="+", default=["lq", "lf", "dq", "df", "tf"],
                        choices=["lq", "lf", "dq", "df", "tf"])
    parser.add_argument("--measures", nargs="+", default=["load", "decode1", "long_prompt", "concurrent"],
                        choices=["load", "decode1", "long_prompt", "concurrent"])
    args = parser.parse_args()
    args.measures.sort(key=lambda m: m != "load")  # "load" (which loads the contender) goes first
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from deepinfer.runtime.loading.default_model import default_model_path

    path = args.model or default_model_path()
    if args.quantize:
        path = llama_copy(path, args.quantize, args.threads)
    contenders: list[Contender] = []
    try:
        import llama_cpp  # noqa: F401

        if "lq" in args.only:
            contenders.append(LlamaCppContender("llama.cpp (file as shipped)", path, args.threads))
        if "lf" in args.only:
            contenders.append(LlamaCppContender("llama.cpp F32", f32_copy(path, args.threads), args.threads))
    except ImportError as exc:
        print(f"llama.cpp skipped: llama-cpp-python is not installed ({exc})")
    if "dq" in args.only:
        contenders.append(DeepInferContender("DeepInfer quantized (default)", path, None))
    if "df" in args.only:
        contenders.append(DeepInferContender("DeepInfer float32", path, "float32"))
    if "tf" in args.only:
        contenders.append(TransformersContender("transformers float32", path))

    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 49000, size=PROMPT_LEN).tolist()
    long_prompt = rng.integers(100, 49000, size=LONG_PROMPT).tolist()
    conc = rng.integers(100, 49000, size=(CONC, PROMPT_LEN)).tolist()
    measures: dict[str, Callable[[Contender], float]] = {
        "load": lambda c: c.load(), "decode1": lambda c: c.decode1(prompt),
        "long_prompt": lambda c: c.long_prompt(long_prompt), "concurrent": lambda c: c.concurrent(conc)}
    units = {"load": "s", "decode1": "tok/s", "long_prompt": "prompt tok/s", "concurrent": "tok/s total"}
    results: dict[tuple[str, str], list[float]] = {}
    print(f"threads={args.threads} rounds={args.rounds} repeats={args.repeats} cpus={os.cpu_count()} "
          f"file={os.path.basename(path)}")
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            if "load" not in args.measures:
                c.load()
            for m in args.measures:
                if m != "load":
                    measures[m](c)  # warm-up run, not counted (first-call allocations, thread pools)
                value = (statistics.median(measures[m](c) for _ in range(args.repeats)) if m != "load"
                         else c.load())
                results.setdefault((c.name, m), []).append(value)
                print(f"round {r + 1}  {c.name:32s} {m:12s} {value:9.2f} {units[m]:14s} load avg {load_avg():5.2f}",
                      flush=True)
            c.close()
    print("\nmedians over rounds, and DeepInfer / llama.cpp ratio per round (higher is better for DeepInfer):")
    names = [c.name for c in contenders]
    for m in args.measures:
        line = [f"{m:12s}"]
        for n in names:
            if (n, m) in results:
                line.append(f"{n.split(' (')[0]}: {statistics.median(results[(n, m)]):.2f}")
        print("  " + " | ".join(line))
        for dn, ln in (("DeepInfer quantized (default)", "llama.cpp (file as shipped)"),
                       ("DeepInfer float32", "llama.cpp F32")):
            if (dn, m) in results and (ln, m) in results:
                ratios = [(b / a if m == "load" else a / b) for a, b in zip(results[(dn, m)], results[(ln, m)],
                                                                            strict=True)]
                print(f"    {dn} / {ln}: " + ", ".join(f"{x:.2f}x" for x in ratios)
                      + f"  (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()

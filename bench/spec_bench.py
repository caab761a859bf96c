"""Speculative decoding against plain decoding, interleaved in one run.

    python bench/spec_bench.py                                   # CPU, default model, n-gram, batch 1
    python bench/spec_bench.py --k 4 --runs 3 --threads 2
    python bench/spec_bench.py --k 7 --lookup-min 3 --match longest --draft-length adaptive
    python bench/spec_bench.py --no-llamacpp --compare 7/3-5/earliest/fixed,7/3-5/longest/adaptive   # in the same rounds
    python bench/spec_bench.py --shape llama3-8b --speculative-oracle --batch 1,32   # GPU, random weights
    python bench/spec_bench.py --method draft_model --draft PATH          # CPU, a draft model for the default model
    python bench/spec_bench.py --shape llama3-8b --method draft_model --draft-shape smollm2-135m \
        --speculative-oracle --batch 1,32                                 # GPU: the draft's cost per step

CPU (default): the input-grounded workload — rewrite a ~300-token code passage with one change,
and answer questions by quoting the prompt — one request at a time (batch 1), greedy, through
``LLM.generate`` with and without ``speculative_config={"method": "ngram", ...}``; the two
engines run alternately (spec, plain, spec, plain ...) so load on a shared machine hits both
alike. Prints tok/s of each run, the median ratio, the acceptance rate, mean accepted length
and per-position acceptance, and checks the outputs are token for token the same. ``--compare``
times several n-gram settings (k, lookup range, ``ngram_match``, ``draft_length``) as engines of
their own in the same rounds, each round's plain run the reference of all of them.

llama.cpp's speculative mode as a contender (CPU): ``llama-cpp-python``'s prompt-lookup decoding
(``Llama(draft_model=LlamaPromptLookupDecoding(...))``) on the same GGUF file (the default
model's), the same token ids, threads and greedy decoding, interleaved in the same rounds: once
with our k and ``--lookup-max`` (its lookup tries n-grams from that length down to 1), once with
its own defaults (10 drafts, n-grams up to 2), and plain llama.cpp. The report gives our
speculative tok/s over the better of its two speculative modes, per run and as a median.
Skipped, with the reason, when ``llama_cpp`` does not import (``--no-llamacpp``: skipped anyway).

``--speculative-oracle``: drafts from a recorded greedy run of the same request (the plain
engine's output), every one of them kept (forced acceptance: oracle mode measures the
verification path's cost, not its output; on random weights the verify and decode kernels break
bf16 near-ties differently), and drafting costs nothing: the ceiling of the verification path. With
``--shape`` (CUDA) the model is a random-weight bf16 model of that shape (bench/gpu_bench.py's
loader), EOS ignored, ``--output-len`` tokens per request, ``--batch`` concurrent requests; one
engine at a time (plain with CUDA graphs and ZOS as configured by default, then speculative),
each run after a warm-up, medians of ``--runs``.

``--method draft_model``: drafts from a draft model (``--draft PATH`` on CPU; ``--draft-shape`` on
CUDA: a random-weight model of that shape with the target's vocabulary). With
``--speculative-oracle`` too, the draft model runs every step but the recorded greedy run's drafts
are verified instead of its own (random weights draft nothing useful): the verification at 100 %
acceptance plus the draft's real cost, which is printed per step (ms and share of the wall time).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index + 1 >= window:
            averages.append(total / window)
    return averages


def normalise(values):
    """Scale values to the range [0, 1]."""
    low = min(values)
    high = max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(value - low) / (high - low) for value in values]


def summary(values, window):
    """A dictionary with the mean, the minimum, the maximum and the moving averages."""
    return {
        "mean": sum(values) / len(values),
        "minimum": min(values),
        "maximum": max(values),
        "moving": moving_average(values, window),
    }
'''

TEXT = ("The lighthouse stood on the northern cliff for two hundred years. Every evening the keeper "
        "climbed the one hundred and twelve steps, trimmed the wick, polished the great lens and "
        "watched the ships pass between the rocks. In the winter of 1887 a storm broke the lens, and "
        "the keeper kept a fire burning on the gallery for nine nights until the new lens arrived "
        "from the city by cart. The ships that passed during those nine nights never knew that the "
        "light they followed was a fire of driftwood and old chairs. ")

WORKLOAD = [
    f"Rewrite the following Python code, renaming the variable `total` to `running_sum`. "
    f"Output only the code.\n\n{CODE}",
    f"Rewrite the following passage, changing the year 1887 to 1891. Output only the passage.\n\n{TEXT}",
    f"Read this code:\n\n{CODE}\nQuote the full definition of the function `normalise` exactly as written above.",
    f"Read this passage:\n\n{TEXT}\nQuote the sentence that says what the keeper did every evening, word for word.",
]


def chat_ids(llm, text: str) -> list[int]:
    return list(llm.apply_chat_template([{"role": "user", "content": text}])["prompt_token_ids"])


def timed(llm, batch, params) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    if llm.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, toks)) / dt, toks


def report_stats(llm) -> str:
    st = llm.engine.speculator.stats
    pos = " ".join(f"{p:.2f}" for p in st.per_position())
    out = (f"acceptance {st.acceptance_rate:.3f}, mean accepted length {st.mean_accepted_length:.2f}, "
           f"per position [{pos}] over {st.num_drafts} verifying steps")
    draft = llm.engine.speculator.draft
    if draft is not None and draft.num_steps:
        out += f"; draft model {1e3 * draft.seconds / draft.num_steps:.2f} ms per drafting step (all runs)"
    return out


def llamacpp_contenders(k: int, lookup_max: int, threads: int, max_tokens: int):  # type: ignore[no-untyped-def]
    """{name: run(prompt ids) -> (tok/s, token ids)} for llama.cpp plain and its prompt-lookup
    speculative modes on the default model's GGUF file, or the reason they cannot run (str)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc})"
    from deepinfer.runtime.loading.default_model import default_model_path

    path = default_model_path()

    def make(draft):  # type: ignore[no-untyped-def]
        # logits_all with a draft: llama-cpp-python 0.3.36 keeps every row's logits then but sizes
        # its score table from the argument (n_batch rows), which a prompt past 512 tokens overruns
        llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512,
                    draft_model=draft, logits_all=draft is not None, verbose=False)

        def run(ids: list[int]) -> tuple[float, list[int]]:
            t0 = time.perf_counter()
            out = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                if llm.token_eos() == tok:
                    break
                out.append(int(tok))
                if len(out) >= max_tokens:
                    break
            return len(out) / (time.perf_counter() - t0), out

        return run

    return {"llama.cpp plain": make(None),
            f"llama.cpp lookup k={k} n<={lookup_max}": make(LlamaPromptLookupDecoding(max_ngram_size=lookup_max,
                                                                                     num_pred_tokens=k)),
            "llama.cpp lookup defaults (10 drafts, n<=2)": make(LlamaPromptLookupDecoding())}


def bench(plain, specs, groups, params, runs: int, oracle: bool, others=None) -> None:  # type: ignore[no-untyped-def]
    """Interleaved timed runs of each group of requests (one generate call per group); ``specs``:
    {name: speculative LLM}, each timed in every round before the plain one (ratios against that
    round's plain run); ``others``: {name: run(prompt ids) -> (tok/s, ids)} contenders timed in
    the same rounds (batch 1), compared with the first of ``specs``."""
    others = others or {}
    first = next(iter(specs))
    ratios: dict[str, list[float]] = {n: [] for n in specs}
    spec_rates: dict[str, list[float]] = {n: [] for n in specs}
    plain_rates: list[float] = []
    other_rates: dict[str, list[float]] = {n: [] for n in others}
    vs_best: list[float] = []
    same = True
    for g, batch in enumerate(groups):
        for run in others.values():  # warm-up (and the prompt into llama.cpp's cache)
            run(batch[0]["prompt_token_ids"])
        # warm-up; the second run is the reference (and the oracle's recorded greedy run): like the
        # timed runs it finds the prompt in the prefix cache (a cold prefill may differ in the last bits)
        timed(plain, batch, params)
        _, ref = timed(plain, batch, params)
        for spec in specs.values():
            if oracle:
                for req, toks in zip(batch, ref, strict=True):
                    spec.engine.speculator.record_oracle(req["prompt_token_ids"], toks)
            timed(spec, batch, params)  # warm-up
        for r in range(runs):
            got_spec = {}
            for n, spec in specs.items():
                got_spec[n], ta = timed(spec, batch, params)
                same &= ta == ref
            b, tb = timed(plain, batch, params)
            same &= tb == ref
            plain_rates.append(b)
            for n, a in got_spec.items():
                spec_rates[n].append(a)
                ratios[n].append(a / b)
            line = ""
            if others:
                got = {n: run(batch[0]["prompt_token_ids"])[0] for n, run in others.items()}
                for n, v in got.items():
                    other_rates[n].append(v)
                best = max(v for n, v in got.items() if "lookup" in n)
                vs_best.append(got_spec[first] / best)
                line = "; " + ", ".join(f"{n} {v:,.1f}" for n, v in got.items()) + f"; {first} / best llama.cpp " \
                    f"speculative {got_spec[first] / best:.2f}x"
            each = ", ".join(f"{n} {a:,.1f} tok/s ({a / b:.2f}x)" for n, a in got_spec.items())
            print(f"  group {g} run {r + 1}: plain {b:,.1f} tok/s, {each}{line} (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    print(f"median plain {statistics.median(plain_rates):,.1f} tok/s")
    for n in specs:
        per_group = "; ".join(f"group {g} {min(ratios[n][g * runs:(g + 1) * runs]):.2f}-"
                              f"{max(ratios[n][g * runs:(g + 1) * runs]):.2f}x" for g in range(len(groups)))
        print(f"median {n} {statistics.median(spec_rates[n]):,.1f} tok/s; median ratio "
              f"{statistics.median(ratios[n]):.2f}x (spread {min(ratios[n]):.2f}-{max(ratios[n]):.2f}, "
              f"{len(ratios[n])} runs; {per_group})")
    for n, v in other_rates.items():
        print(f"median {n} {statistics.median(v):,.1f} tok/s")
    if vs_best:
        print(f"median {first} / best llama.cpp speculative mode: {statistics.median(vs_best):.2f}x "
              f"(spread {min(vs_best):.2f}-{max(vs_best):.2f})")
    for n, spec in specs.items():
        print(f"{n} stats: {report_stats(spec)}")
    print(f"outputs token for token equal to plain decoding: {same}")


def draft_shape_dir(shape: str, vocab: int) -> str:
    """A model folder of ``shape`` with ``vocab`` tokens (a random-weight draft for a target of
    that vocabulary)."""
    import json

    sys.path.insert(0, os.path.join(HERE, "..", "tests", "runtime"))
    from gpu_shapes import write_shape_dir

    path = write_shape_dir(tempfile.mkdtemp(prefix="draft-"), shape)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = vocab
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=5)
    p.add_argument("--match", choices=("earliest", "latest", "longest"), default="earliest",
                   help="n-gram: speculative_config's ngram_match")
    p.add_argument("--draft-length", choices=("fixed", "adaptive"), default="fixed",
                   help="n-gram: speculative_config's draft_length")
    p.add_argument("--compare", default=None,
                   help="CPU n-gram: several speculative settings timed in the same rounds, comma-separated "
                        "K/MIN-MAX/MATCH/DRAFT_LENGTH, e.g. 7/3-5/earliest/fixed,7/3-5/longest/adaptive "
                        "(instead of --k, --lookup-*, --match, --draft-length)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speculative-oracle", action="store_true",
                   help="drafts from a recorded greedy run of the same request (the verification ceiling)")
    p.add_argument("--shape", default=None, help="CUDA: a random-weight model of this shape (tests/runtime/gpu_shapes.py)")
    p.add_argument("--batch", default="1", help="CUDA: concurrent requests, comma-separated sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--method", choices=("ngram", "draft_model"), default="ngram",
                   help="the drafting method (--speculative-oracle without draft_model: the oracle alone)")
    p.add_argument("--draft", default=None, help="CPU, --method draft_model: the draft model's path")
    p.add_argument("--no-llamacpp", action="store_true", help="CPU: leave llama.cpp's contenders out")
    p.add_argument("--draft-shape", default="smollm2-135m",
                   help="CUDA, --method draft_model: the draft's shape (random weights, the target's vocabulary)")
    args = p.parse_args()
    import torch  # first: before any deepinfer native module (the H200 image segfaults otherwise)
    from deepinfer import LLM, SamplingParams

    if args.method == "draft_model":
        spec_cfg = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
        if args.shape is None and not args.draft:
            p.error("--method draft_model needs --draft PATH on CPU")
    elif args.speculative_oracle:
        spec_cfg = {"method": "oracle", "num_speculative_tokens": args.k}
    else:
        spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                    "prompt_lookup_max": args.lookup_max, "ngram_match": args.match,
                    "draft_length": args.draft_length}
    if args.shape is None:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        common = dict(num_threads=args.threads, max_num_seqs=4, max_model_len=2048)
        plain = LLM(**common)
        cfgs = {"spec": spec_cfg}
        if args.compare:
            if args.method != "ngram" or args.speculative_oracle:
                p.error("--compare is for the n-gram method")
            cfgs = {}
            for item in args.compare.split(","):
                k, lookup, match, length = item.split("/")
                lo, hi = lookup.split("-")
                cfgs[item] = {"method": "ngram", "num_speculative_tokens": int(k), "prompt_lookup_min": int(lo),
                              "prompt_lookup_max": int(hi), "ngram_match": match, "draft_length": length}
        specs = {n: LLM(**common, speculative_config=c) for n, c in cfgs.items()}
        print(f"== CPU default model, {args.threads} threads, batch 1, greedy, max_tokens {args.max_tokens}, "
              f"{list(cfgs.values())}", flush=True)
        groups = [[{"prompt_token_ids": chat_ids(plain, w)}] for w in WORKLOAD]
        others = None
        if not args.no_llamacpp and args.method == "ngram" and not args.speculative_oracle:
            others = llamacpp_contenders(args.k, args.lookup_max, args.threads, args.max_tokens)
            if isinstance(others, str):
                print(f"llama.cpp skipped: {others}", flush=True)
                others = None
        bench(plain, specs, groups, SamplingParams(temperature=0, max_tokens=args.max_tokens), args.runs,
              args.speculative_oracle, others)
        return
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "runtime"))
    import deepinfer.runtime.loading.model_loader as ml
    from gpu_bench import _load_on_device
    from gpu_shapes import SHAPES, write_shape_dir

    ml.load_model = _load_on_device  # type: ignore[assignment]
    shape_dir = write_shape_dir(tempfile.mkdtemp(prefix="shape-"), args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    if args.method == "draft_model":  # the draft's shape with the target's vocabulary (one tokenizer)
        spec_cfg["model"] = draft_shape_dir(args.draft_shape, vocab)
    sizes = [int(b) for b in args.batch.split(",")]
    g = torch.Generator().manual_seed(0)
    max_len = args.input_len + args.output_len + args.k + 16
    common = dict(dtype="bfloat16", dummy_weights=True, max_num_seqs=max(sizes), max_model_len=max_len,
                  enforce_eager=args.enforce_eager, num_kv_blocks=2048)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"== {args.shape} bf16 random weights on {where}; {spec_cfg}; one engine at a time (plain, then "
          f"speculative), medians of {args.runs} runs after a warm-up", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    groups = {b: [{"prompt_token_ids": q} for q in torch.randint(100, vocab - 100, (b, args.input_len),
                                                                  generator=g).tolist()] for b in sizes}
    rates: dict[str, dict[int, list[float]]] = {"plain": {}, "spec": {}}
    outputs: dict[str, dict[int, list[list[int]]]] = {"plain": {}, "spec": {}}
    for mode in ("plain", "spec"):
        llm = LLM(shape_dir, **common, speculative_config=spec_cfg if mode == "spec" else None)
        print(f"  {mode}: {llm!r}", flush=True)
        for b, batch in groups.items():
            if mode == "spec" and args.speculative_oracle:
                for req, toks in zip(batch, outputs["plain"][b], strict=True):
                    llm.engine.speculator.record_oracle(req["prompt_token_ids"], toks)
            timed(llm, batch, params)  # warm-up (the plain one is the oracle's recorded greedy run)
            if mode == "spec":
                llm.engine.speculator.stats.__init__(args.k)
            draft = getattr(llm.engine.speculator, "draft", None) if mode == "spec" else None
            before = (draft.seconds, draft.num_steps) if draft is not None else None
            rates[mode][b] = []
            t0 = time.perf_counter()
            for r in range(args.runs):
                rate, toks = timed(llm, batch, params)
                rates[mode][b].append(rate)
                outputs[mode][b] = toks
                print(f"  {mode} batch {b} run {r + 1}: {rate:,.1f} output tok/s", flush=True)
            if mode == "spec":
                print(f"  spec batch {b} stats: {report_stats(llm)}", flush=True)
            if draft is not None and before is not None:
                secs, steps = draft.seconds - before[0], draft.num_steps - before[1]
                wall = time.perf_counter() - t0
                print(f"  spec batch {b} draft model ({args.draft_shape} shape): {1e3 * secs / max(steps, 1):.2f} ms "
                      f"per drafting step ({steps} steps, k = {args.k}: {args.k} draft forwards each), "
                      f"{100 * secs / wall:.0f} % of the wall time; whole step {1e3 * wall / max(steps, 1):.2f} ms",
                      flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for b in sizes:
        sp, pl = statistics.median(rates["spec"][b]), statistics.median(rates["plain"][b])
        print(f"batch {b}: spec {sp:,.1f} tok/s, plain {pl:,.1f} tok/s (medians), ratio {sp / pl:.2f}x; "
              f"outputs equal: {outputs['spec'][b] == outputs['plain'][b]}", flush=True)


if __name__ == "__main__":
    main()

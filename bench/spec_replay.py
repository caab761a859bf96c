"""Choose n-gram settings without timing noise: replay prompt lookup on recorded greedy outputs.

    python bench/spec_replay.py --record out.json [--max-tokens 256]      # decode spec_bench's workload once
    python bench/spec_replay.py --replay out.json --costs 1,1.32,1.75,2.03,2.21,2.45,2.75,3.04
    python bench/spec_replay.py --record held.json --workload heldout     # six other input-grounded prompts
    python bench/spec_replay.py --replay out.json,held.json --policies --k 4,7   # match x draft length

Greedy speculative decoding is lossless, so which drafts a step keeps is fixed by the plain
greedy output: step by step, the n-gram drafts of the text so far (``propose_ngram``, as the
engine calls it) are kept up to the first one that differs from the recorded output, plus one
token. Replaying that for every (k, prompt_lookup_min, prompt_lookup_max) gives each setting's
steps and their row counts exactly; the cost of a step of R rows relative to a one-token decode
step (``--costs``: R = 1, 2, ... as printed by ``bench/cpu_decode_profile.py --verify-rows``)
turns that into a modelled speed-up over plain decoding (output tokens after the first / the
summed step costs), which the noise of a shared machine does not move. Measure the chosen
setting with bench/spec_bench.py afterwards: the model leaves out the per-step host work and the
prompt's prefill.

``--policies``: for each k and lookup range in ``--lookups``, every ``ngram_match`` (earliest,
latest, longest) with each ``draft_length`` (fixed, adaptive: ``next_draft_cap`` is replayed from
the kept counts, as the engine does), per record file: the mean over its requests, the worst
request and each request's modelled speed-up. ``--workload heldout`` records six prompts of the
same kinds that spec_bench does not time (another class to rewrite and quote, another passage),
to check that a setting chosen on spec_bench's four prompts is not fitted to them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


CODE2 = '''class Inventory:
    """Items in stock, by name."""

    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        have = self.items.get(name, 0)
        if count > have:
            raise KeyError(name)
        self.items[name] = have - count
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
'''

TEXT2 = ("The river town held a market every Saturday morning. Farmers brought apples, cheese and bread "
         "from the valley, and fishermen sold the night's catch from wooden crates beside the bridge. In the "
         "spring of 1902 the river flooded the square, and the market moved to the church hill for three "
         "weeks while the townspeople cleared the mud from the cobbles. The old baker said it was the best "
         "market he had ever seen, because everyone walked up the hill together. ")

HELDOUT = [
    f"Rewrite the following Python code, renaming the method `remove` to `take`. Output only the code.\n\n{CODE2}",
    f"Rewrite the following passage, changing the year 1902 to 1910. Output only the passage.\n\n{TEXT2}",
    f"Read this code:\n\n{CODE2}\nQuote the full definition of the method `add` exactly as written above.",
    f"Read this passage:\n\n{TEXT2}\nQuote the sentence that says what happened in the spring, word for word.",
    "Rewrite the following passage in the past tense where needed, keeping everything else the same. Output only "
    f"the passage.\n\n{TEXT2}",
    f"Add a docstring to every method of the following class. Output only the code.\n\n{CODE2}",
]


def replay(prompt: list[int], output: list[int], k: int, lo: int, hi: int, costs: list[float],
           match: str = "earliest", draft_length: str = "fixed") -> tuple[float, int]:
    """(modelled speed-up, verifying steps) of n-gram speculation with (k, lo, hi), the
    ``ngram_match`` and the ``draft_length`` on one request."""
    from deepinfer.runtime.speculative.ngram import next_draft_cap, propose_ngram

    pos, total, steps, cap = 1, 0.0, 0, k  # the first output token comes from the prefill
    while pos < len(output):
        drafts = propose_ngram(np.asarray(prompt + output[:pos], np.int32), lo, hi, cap, match)
        kept = 0
        while kept < len(drafts) and pos + kept < len(output) and drafts[kept] == output[pos + kept]:
            kept += 1
        total += costs[1 + len(drafts)]  # a step of 1 + d rows
        steps += len(drafts) > 0
        if draft_length == "adaptive":
            cap = next_draft_cap(cap, k, len(drafts), kept)
        pos += kept + 1
    return (len(output) - 1) / max(total, 1e-9), steps


def policies(files: list[str], ks: list[int], lookups: list[tuple[int, int]], costs: list[float]) -> None:
    """Every ngram_match x draft_length at each k and lookup range, per record file."""
    sets = []
    for path in files:
        with open(path) as f:
            sets.append((os.path.basename(path), json.load(f)))
    print(f"modelled speed-up over plain decoding: mean over a file's requests, worst request [each request]; "
          f"costs {costs[1:]}")
    for k, (lo, hi) in itertools.product(ks, lookups):
        for match, draft_length in itertools.product(("earliest", "latest", "longest"), ("fixed", "adaptive")):
            cells = []
            for name, recs in sets:
                got = [replay(r["prompt"], r["output"], k, lo, hi, costs, match, draft_length)[0] for r in recs]
                per = ", ".join(f"{g:.2f}" for g in got)
                cells.append(f"{name}: {statistics.mean(got):.3f} worst {min(got):.2f} [{per}]")
            print(f"  k={k} lookup {lo}-{hi} {match:8s} {draft_length:8s}  " + "  |  ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", default=None, help="decode spec_bench's workload greedily, write it here")
    p.add_argument("--replay", default=None, help="a --record file")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--costs", default="1,1.32,1.75,2.03,2.21,2.45,2.75,3.04",
                   help="step cost of R = 1, 2, ... rows relative to R = 1 (the last one repeats past the end)")
    p.add_argument("--k", default="1,2,3,4,5,6,7")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--workload", choices=("bench", "heldout"), default="bench",
                   help="--record: spec_bench's four prompts or six held-out ones")
    p.add_argument("--policies", action="store_true",
                   help="--replay (comma-separated files): every ngram_match x draft_length (see the docstring)")
    p.add_argument("--lookups", default="2-5,3-5", help="--policies: prompt_lookup_min-max ranges")
    args = p.parse_args()
    if args.record:
        import torch  # noqa: F401  (first, before any deepinfer native module)
        from deepinfer import LLM, SamplingParams

        sys.path.insert(0, HERE)
        from spec_bench import WORKLOAD, chat_ids

        workload = WORKLOAD if args.workload == "bench" else HELDOUT

        # the n-gram engine gives the plain greedy output (lossless) in fewer steps
        llm = LLM(num_threads=args.threads, max_model_len=2048,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
        recs = []
        for text in workload:
            ids = chat_ids(llm, text)
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=args.max_tokens),
                               use_tqdm=False)
            recs.append({"prompt": ids, "output": list(out[0].outputs[0].token_ids)})
        with open(args.record, "w") as f:
            json.dump(recs, f)
        print(f"recorded {len(recs)} requests ({sum(len(r['output']) for r in recs)} output tokens) to {args.record}")
    if not args.replay:
        return
    costs = [0.0] + [float(c) for c in args.costs.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    costs += [costs[-1]] * (max(ks) + 2 - len(costs))
    if args.policies:
        lookups = [(int(a), int(b)) for a, b in (r.split("-") for r in args.lookups.split(","))]
        policies(args.replay.split(","), ks, lookups, costs)
        return
    with open(args.replay) as f:
        recs = json.load(f)
    rows = []
    for k, lo, hi in itertools.product(ks, (1, 2, 3, 4, 5), (2, 3, 4, 5, 6)):
        if lo > hi:
            continue
        got = [replay(r["prompt"], r["output"], k, lo, hi, costs) for r in recs]
        rows.append((statistics.mean(g[0] for g in got), k, lo, hi, [round(g[0], 2) for g in got]))
    rows.sort(reverse=True)
    print(f"modelled speed-up over plain decoding (mean over {len(recs)} requests; per request), costs {costs[1:]}")
    for s, k, lo, hi, per in rows[:args.top]:
        print(f"  {s:.3f}  k={k} prompt_lookup_min={lo} prompt_lookup_max={hi}  {per}")
    for s, k, lo, hi, per in rows:
        if (k, lo, hi) == (4, 2, 5):
            print(f"  {s:.3f}  k=4 with the defaults (2..5)  {per}")


if __name__ == "__main__":
    main()

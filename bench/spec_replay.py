"""Choose n-gram settings without timing noise: replay prompt lookup on recorded greedy outputs.

    python bench/spec_replay.py --record out.json [--max-tokens 256]      # decode spec_bench's workload once
    python bench/spec_replay.py --replay out.json --costs 1,1.32,1.75,2.03,2.21,2.45,2.75,3.04

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


def replay(prompt: list[int], output: list[int], k: int, lo: int, hi: int, costs: list[float]) -> tuple[float, int]:
    """(modelled speed-up, verifying steps) of n-gram speculation with (k, lo, hi) on one request."""
    from deepinfer.runtime.speculative.ngram import propose_ngram

    pos, total, steps = 1, 0.0, 0  # the first output token comes from the prefill
    while pos < len(output):
        drafts = propose_ngram(np.asarray(prompt + output[:pos], np.int32), lo, hi, k)
        kept = 0
        while kept < len(drafts) and pos + kept < len(output) and drafts[kept] == output[pos + kept]:
            kept += 1
        total += costs[1 + len(drafts)]  # a step of 1 + d rows
        steps += len(drafts) > 0
        pos += kept + 1
    return (len(output) - 1) / max(total, 1e-9), steps


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
    args = p.parse_args()
    if args.record:
        import torch  # noqa: F401  (first, before any deepinfer native module)
        from deepinfer import LLM, SamplingParams

        sys.path.insert(0, HERE)
        from spec_bench import WORKLOAD, chat_ids

        # the n-gram engine gives the plain greedy output (lossless) in fewer steps
        llm = LLM(num_threads=args.threads, max_model_len=2048,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
        recs = []
        for text in WORKLOAD:
            ids = chat_ids(llm, text)
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=args.max_tokens),
                               use_tqdm=False)
            recs.append({"prompt": ids, "output": list(out[0].outputs[0].token_ids)})
        with open(args.record, "w") as f:
            json.dump(recs, f)
        print(f"recorded {len(recs)} requests ({sum(len(r['output']) for r in recs)} output tokens) to {args.record}")
    if not args.replay:
        return
    with open(args.replay) as f:
        recs = json.load(f)
    costs = [0.0] + [float(c) for c in args.costs.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    costs += [costs[-1]] * (max(ks) + 2 - len(costs))
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

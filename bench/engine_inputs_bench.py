"""Step-builder benchmark: model-input and sampler-input preparation per step.

For B = 64, 256, 1024 decoding sequences (2048-token contexts, block size 16, mixed sampling
parameters with penalties for a quarter of them) it prints the median per step of
  * prepare_decode_v4 + prepare_sampler_inputs (block tables unchanged: the same step re-prepared),
  * the same in steady state (one new token per sequence per step, so block rows change every 16 steps),
  * the ZOS variant (prepare_decode_zos_inputs + prepare_sampler_inputs),
  * a numpy copy of the same output bytes (the floor this is compared to),
  * a whole engine step: schedule + metadata + decode inputs + sampler inputs + update,
and one 8192-token prefill step (ns per token). Penalty counts go out in "incremental" mode (the
default: per-slot updates, O(new tokens) per sequence) and, side by side, in "full" mode (every
penalized sequence's distinct tokens each step); "no-pen" is the same batch without penalties.

Run: PYTHONPATH=<engine build>/pkg python bench/engine_inputs_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from deepinfer_engine import _engine as E

BLOCK = 16
CONTEXT = 2048
VOCAB = 32000


def buffers(max_tokens, max_seqs, width, zos=False):
    b = dict(input_ids=np.zeros(max_tokens, np.int32), positions=np.zeros(max_tokens, np.int32),
             slot_mapping=np.zeros(max_tokens, np.int64), query_start_loc=np.zeros(max_seqs + 1, np.int32),
             seq_lens=np.zeros(max_seqs, np.int32), block_tables=np.zeros((max_seqs, width), np.int32),
             logits_indices=np.zeros(max_tokens, np.int32))
    if zos:
        b["zos_source_index"] = np.zeros(max_tokens, np.int32)
    return b


def make_scheduler(B, rng, prompt_len=CONTEXT - 8, max_tokens=4096, penalties=True):
    blocks = B * (CONTEXT // BLOCK + 8) + 64
    s = E.Scheduler(num_blocks=blocks, block_size=BLOCK, max_num_seqs=B, max_num_batched_tokens=8192,
                    max_model_len=CONTEXT + 4096, vocab_size=VOCAB, enable_prefix_caching=False,
                    num_lookahead_slots=1)  # ZOS: a slot for the pending token
    for i in range(B):
        kw = dict(temperature=[0.0, 0.7, 1.0, 0.8][i % 4], top_k=[-1, 50, -1, 20][i % 4],
                  top_p=[1.0, 0.9, 0.95, 1.0][i % 4], seed=i if i % 3 == 0 else None, ignore_eos=True)
        if penalties and i % 4 == 3:  # a quarter with penalties
            kw.update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1)
        s.add_request(f"r{i}", rng.integers(0, VOCAB, prompt_len, dtype=np.int32),
                      E.SamplingParams(max_tokens=max_tokens, **kw))
    return s


def run_prefill(s, rng):
    while True:
        out = s.schedule()
        done = out.num_decodes == len(out)
        s.update(rng.integers(0, VOCAB, out.num_sample_rows, dtype=np.int32))
        if done:
            return


def median_ns(fn, reps):
    t = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        t.append(time.perf_counter_ns() - t0)
    return statistics.median(t)


def output_bytes(args, si):
    T, R = args.num_tokens, args.num_rows
    n = T * (4 + 4 + 8 + 4) + (R + 1) * 4 + R * 4  # ids, positions, slots, logits idx, qsl, seq_lens
    k, tr = si.kernel, si.transform
    n += k.num_rows * (4 * 4 + 4 + 8 + 8 + 4)     # kernel rows
    n += tr.num_rows * (3 * 4 + 4 + 4) + 4 * (tr.num_rows + 1) * 4  # penalties, pending source, slots; CSR offsets
    n += len(tr.penalty_token_ids) * 9 + len(tr.banned_token_ids) * 4  # full mode's penalty lists
    U = tr.num_penalty_updates                        # incremental mode's updates
    n += U * (4 + 1) + (U + 1) * 4 + len(tr.penalty_update_token_ids) * 5
    n += si.driver.num_rows * (8 + 4 + 4) + si.decode.num_rows * 4
    return n


def bench_batch(B, reps, rng, penalties=True, penalty_counts="incremental"):
    s = make_scheduler(B, rng, penalties=penalties)
    run_prefill(s, rng)
    width = CONTEXT // BLOCK + 256
    bufs = buffers(max(B, 64) * 2, B, width, zos=True)
    graph = [g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if g <= B]
    args = E.PrepareArgs(block_size=BLOCK, max_model_len=CONTEXT + 4096, graph_batch_sizes=graph, **bufs)
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs(penalty_counts=penalty_counts)
    tokens = rng.integers(0, VOCAB, B, dtype=np.int32)
    res = {}

    # Steady state: schedule -> build -> prepare -> sampler -> update, one token per sequence per step.
    parts = {"schedule": [], "build": [], "decode": [], "sampler": [], "update": [], "zos": []}
    for _step in range(reps):
        t0 = time.perf_counter_ns()
        out = s.schedule()
        t1 = time.perf_counter_ns()
        pool.build(s)
        t2 = time.perf_counter_ns()
        E.prepare_decode_v4(args, pool)
        t3 = time.perf_counter_ns()
        E.prepare_sampler_inputs(args, pool, si)
        t4 = time.perf_counter_ns()
        s.update(tokens[: out.num_sample_rows])
        t5 = time.perf_counter_ns()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            parts[k].append(v)
    med = {k: statistics.median(v) for k, v in parts.items() if v}
    res["steady_inputs"] = med["decode"] + med["sampler"]
    res["steady_build"] = med["build"]
    res["whole_step"] = sum(med[k] for k in ("schedule", "build", "decode", "sampler", "update"))
    res["schedule_update"] = med["schedule"] + med["update"]

    # No block table changed: re-prepare the same scheduled step.
    out = s.schedule()
    pool.build(s)

    def sync():
        E.prepare_decode_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, si)

    sync()
    res["unchanged_inputs"] = median_ns(sync, reps)

    def zos():
        E.prepare_decode_zos_inputs(args, pool, args)
        E.prepare_sampler_inputs(args, pool, si)

    E.prepare_decode_v4(args, pool)
    res["zos_inputs"] = median_ns(zos, reps)
    sync()
    nbytes = output_bytes(args, si)
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    res["numpy_copy"] = median_ns(lambda: np.copyto(dst, src), reps)
    res["bytes"] = nbytes
    # The same plus the batch's block-table rows: the bytes a builder that keeps no row cache (a
    # numpy implementation, vLLM's CPU block table) ships every step.
    bt_bytes = 4 * int(np.sum(-(-bufs["seq_lens"][: args.num_rows] // BLOCK)))
    src_bt, dst_bt = np.ones(nbytes + bt_bytes, np.uint8), np.zeros(nbytes + bt_bytes, np.uint8)
    res["numpy_copy_bt"] = median_ns(lambda: np.copyto(dst_bt, src_bt), reps)
    s.update(tokens[: out.num_sample_rows])
    return res


def bench_prefill(rng, reps):
    s = E.Scheduler(num_blocks=8192 // BLOCK * 4 + 64, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=8192,
                    max_model_len=8192, vocab_size=VOCAB, enable_prefix_caching=False)
    s.add_request("p", rng.integers(0, VOCAB, 8192, dtype=np.int32), E.SamplingParams(max_tokens=1, presence_penalty=0.5))
    s.schedule()
    bufs = buffers(8192, 8, 8192 // BLOCK)
    args = E.PrepareArgs(block_size=BLOCK, max_model_len=8192, **bufs)
    pool, si = E.SequenceMetadataPool(), E.SamplerInputs()
    pool.build(s)

    def step():
        si.reset_penalty_tables()  # every repetition is the sequence's first step: its 8192 tokens go out
        E.prepare_prompt_v4(args, pool)
        E.prepare_sampler_inputs(args, pool, si)

    step()
    t = median_ns(step, reps)
    assert args.num_tokens == 8192
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps (CI smoke run)")
    opts = ap.parse_args()
    rng = np.random.default_rng(0)
    reps = 15 if opts.quick else 60
    print(f"engine inputs benchmark: contexts {CONTEXT}, block size {BLOCK}, a quarter with penalties; "
          f"median of {reps} steps")
    hdr = (f"{'B':>5} {'penalties':>12} | {'unchanged µs':>12} {'ns/seq':>7} | {'steady µs':>9} {'ns/seq':>7} | "
           f"{'ZOS µs':>8} {'ns/seq':>7} | {'np copy µs':>10} {'ratio':>6} | {'+bt µs':>7} {'ratio':>6} | "
           f"{'build ns/seq':>12} | "
           f"{'whole step µs':>13} {'ns/seq':>7} | {'sched+upd ns/seq':>16}")
    print(hdr)
    print("-" * len(hdr))
    for B in (64, 256, 1024):
        runs = (("incremental", bench_batch(B, reps, rng)),
                ("full", bench_batch(B, reps, rng, penalty_counts="full")),
                ("no-pen", bench_batch(B, reps, rng, penalties=False)))
        for label, r in runs:
            print(f"{B:>5} {label:>12} | {r['unchanged_inputs'] / 1e3:>12.1f} {r['unchanged_inputs'] / B:>7.0f} | "
                  f"{r['steady_inputs'] / 1e3:>9.1f} {r['steady_inputs'] / B:>7.0f} | {r['zos_inputs'] / 1e3:>8.1f} "
                  f"{r['zos_inputs'] / B:>7.0f} | {r['numpy_copy'] / 1e3:>10.1f} "
                  f"{r['unchanged_inputs'] / max(r['numpy_copy'], 1):>6.1f} | {r['numpy_copy_bt'] / 1e3:>7.1f} "
                  f"{r['unchanged_inputs'] / max(r['numpy_copy_bt'], 1):>6.1f} | {r['steady_build'] / B:>12.0f} | "
                  f"{r['whole_step'] / 1e3:>13.1f} {r['whole_step'] / B:>7.0f} | {r['schedule_update'] / B:>16.0f}")
    t = bench_prefill(rng, max(5, reps // 4))
    print(f"8192-token prefill step (prepare_prompt_v4 + prepare_sampler_inputs): {t / 1e3:.1f} µs, "
          f"{t / 8192:.1f} ns/token")
    print("columns: unchanged = prepare_decode_v4 + prepare_sampler_inputs with no block-table change; steady = "
          "the same with one new token per sequence per step; ZOS = prepare_decode_zos_inputs + "
          "prepare_sampler_inputs; np copy = numpy copy of the same output bytes (ratio = unchanged / copy); "
          "+bt = the same plus the batch's block-table rows (what a builder without a row cache rewrites); "
          "build = SequenceMetadataPool.build; whole step = schedule + build + decode inputs + sampler inputs + "
          "update. penalties: incremental = SamplerInputs(penalty_counts='incremental') (per-slot updates), "
          "full = penalty_counts='full' (every penalized sequence's counts each step), no-pen = the same batch "
          "without penalty requests.")


if __name__ == "__main__":
    main()

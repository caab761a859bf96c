"""Coverage-guided fuzzing (atheris / libFuzzer) of the engine calls that take buffers.

    python tests/reliability/fuzz_engine_buffers.py -max_total_time=60 [-runs=N] [corpus_dir]

Each input picks one call and builds its arguments from the fuzzer's bytes: arrays of any dtype
(int8..int64, unsigned, float16..64, bool), rank 0-3, sizes 0-70, C / Fortran / strided layout,
read-only or writable, values anywhere (negative, huge, NaN), lists of floats, None. A call may
return or raise ValueError / TypeError / OverflowError / IndexError; the scheduler must stay
consistent (check_invariants() == "") and a normal step must still work. Anything else — a
crash, a sanitizer report, another exception — is a finding (libFuzzer saves the input).

Coverage feedback comes from the Python harness and pybind11's argument paths that atheris sees;
the C++ engine itself is not built with libFuzzer instrumentation, so run it against the ASan
build (LD_PRELOAD the sanitizer runtimes) to turn silent memory errors into findings.
Known, reported bugs that raise the wrong exception type (RuntimeError "Unable to cast",
build/notes/requests-for-core-I.md B7) are counted, not reported again.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deepinfer-meta" / "src"))
from deepinfer._C import engine as E

VOCAB = 64
BS = 4
T, S, W = 128, 8, 16
DTYPES = [np.int32, np.int64, np.float32, np.float64, np.int8, np.uint32, np.int16, np.uint64, np.float16, np.bool_]
ALLOWED = (ValueError, TypeError, OverflowError, IndexError)
STATS = {"calls": 0, "rejected": 0, "known_cast_bug": 0, "accepted": 0}


def make_array(fdp: atheris.FuzzedDataProvider, prefer=np.int32, shape=None):
    """An array (or a list / None) built from the fuzzer's bytes."""
    kind = fdp.ConsumeIntInRange(0, 15)
    if kind == 0:
        return None
    if kind == 1:
        return [fdp.ConsumeFloat() for _ in range(fdp.ConsumeIntInRange(0, 6))]
    if kind == 2:
        return [fdp.ConsumeIntInRange(-(2**40), 2**40) for _ in range(fdp.ConsumeIntInRange(0, 6))]
    dtype = prefer if kind < 10 else DTYPES[fdp.ConsumeIntInRange(0, len(DTYPES) - 1)]
    if shape is None or fdp.ConsumeIntInRange(0, 5) == 0:
        ndim = fdp.ConsumeIntInRange(0, 3)
        shape = tuple(fdp.ConsumeIntInRange(0, 70) for _ in range(ndim))
    n = int(np.prod(shape)) if shape else 1
    mode = fdp.ConsumeIntInRange(0, 7)
    if mode == 0:       # values anywhere
        raw = fdp.ConsumeBytes(n * 8)
        base = np.frombuffer(raw.ljust(n * 8, b"\0"), dtype=np.int64)[:n].astype(dtype, copy=True) \
            if np.issubdtype(dtype, np.integer) or dtype is np.bool_ else \
            np.frombuffer(raw.ljust(n * 8, b"\0"), dtype=np.float64)[:n].astype(dtype)
    else:               # plausible values (token ids, small counts)
        base = np.array([fdp.ConsumeIntInRange(-2, VOCAB + 1) for _ in range(min(n, 64))] + [0] * max(0, n - 64),
                        dtype=np.int64).astype(dtype)
    arr = base.reshape(shape) if shape else base.reshape(())
    layout = fdp.ConsumeIntInRange(0, 9)
    if layout == 1 and arr.ndim >= 1:
        big = np.repeat(arr, 2, axis=0)
        arr = big[::2]                                  # non-contiguous
    elif layout == 2 and arr.ndim == 2:
        arr = np.asfortranarray(arr)
    elif layout == 3:
        arr.flags.writeable = False
    return arr


class Harness:
    def __init__(self):
        self.reset()

    def reset(self):
        self.sched = E.Scheduler(num_blocks=96, block_size=BS, max_num_seqs=S, max_num_batched_tokens=64,
                                 max_model_len=48, vocab_size=VOCAB, eos_token_id=1, num_lookahead_slots=3,
                                 watermark=0.0)
        self.bufs = dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                         slot_mapping=np.zeros(T, np.int64), query_start_loc=np.zeros(S + 1, np.int32),
                         seq_lens=np.zeros(S, np.int32), block_tables=np.zeros((S, W), np.int32),
                         logits_indices=np.zeros(T, np.int32), zos_source_index=np.zeros(T, np.int32))
        self.args = E.PrepareArgs(block_size=BS, max_model_len=48, graph_batch_sizes=[1, 2, 4, 8], **self.bufs)
        self.pool = E.SequenceMetadataPool()
        self.si = E.SamplerInputs()
        self.out_pool = E.RequestOutputPool(max_size=8)
        self.next_id = 0
        self.steps = 0

    def ensure_step(self):
        """Keep a prepared step in flight (requests added as they finish)."""
        s = self.sched
        if s.step_in_flight:
            return
        while s.num_unfinished_requests < 4:
            self.next_id += 1
            s.add_request(f"r{self.next_id}", [(self.next_id * 7 + i) % (VOCAB - 2) + 2 for i in range(3 + self.next_id % 9)], E.SamplingParams(max_tokens=1 + self.next_id % 5, prompt_logprobs=1 if self.next_id % 3 == 0 else None, logprobs=1 if self.next_id % 4 == 0 else None))
        out = s.schedule()
        self.rows = out.num_sample_rows
        self.pool.build(s)
        if out.num_decodes == len(out):
            E.prepare_decode_v4(self.args, self.pool)
        else:
            E.prepare_prompt_v4(self.args, self.pool)
        E.prepare_sampler_inputs(self.args, self.pool, self.si)
        self.steps += 1
        if self.steps > 500:
            self.reset()
            self.ensure_step()

    def normal_update(self):
        s = self.sched
        if s.step_in_flight:
            r = self.rows
            s.update(np.full(r, 5, np.int32), logprobs=np.zeros(r, np.float32),
                     topk_token_ids=np.full((r, 1), 5, np.int32), topk_logprobs=np.zeros((r, 1), np.float32))
        E.build_request_outputs(s, self.out_pool)

    def check(self):
        problem = self.sched.check_invariants()
        if problem:
            raise AssertionError(f"engine inconsistent after a call: {problem}")


H = None


def call_one(fdp: atheris.FuzzedDataProvider):
    h = H
    h.ensure_step()
    target = fdp.ConsumeIntInRange(0, 11)
    s, rows = h.sched, h.rows
    if target == 0:
        s.update(make_array(fdp, np.int32, (rows,)), logprobs=make_array(fdp, np.float32, (rows,)),
                 topk_token_ids=make_array(fdp, np.int32, (rows, 1)), topk_logprobs=make_array(fdp, np.float32, (rows, 1)))
    elif target == 1:
        E.process_MTPInfo(s, make_array(fdp, np.int32, (rows,)), make_array(fdp, np.int32, (rows, 2)),
                          make_array(fdp, np.int32, (rows, 2)), make_array(fdp, np.float32, (rows, 2)))
    elif target == 2:
        n = h.si.prompt_logprobs.num_rows
        E.update_prompt_logprobs(s, h.si, make_array(fdp, np.float32, (n,)), make_array(fdp, np.int32, (n, 1)),
                                 make_array(fdp, np.float32, (n, 1)))
    elif target == 3:
        names = list(h.bufs)
        bufs = {k: (make_array(fdp, v.dtype.type, v.shape) if fdp.ConsumeBool() else v.copy()) for k, v in h.bufs.items()}
        if fdp.ConsumeBool():
            bufs.pop(names[fdp.ConsumeIntInRange(0, len(names) - 1)])
        E.PrepareArgs(block_size=fdp.ConsumeIntInRange(-2, 40), max_model_len=fdp.ConsumeIntInRange(-2, 100),
                      graph_batch_sizes=make_array(fdp, np.int64), **bufs)
    elif target in (4, 5, 6, 7):
        pool = E.SequenceMetadataPool()
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            toks = make_array(fdp, np.int32)
            plp = fdp.ConsumeIntInRange(-1, 3)
            params = E.SamplingParams(prompt_logprobs=None if plp < 0 else plp,
                                      temperature=fdp.ConsumeFloat() if fdp.ConsumeBool() else 1.0,
                                      banned_token_ids=make_array(fdp, np.int32) if fdp.ConsumeBool() else None)
            pool.add_sequence(seq_id=fdp.ConsumeIntInRange(-1, 2**40), request_id="f", token_ids=toks,
                              num_prompt_tokens=fdp.ConsumeIntInRange(-1, 80),
                              num_computed_tokens=fdp.ConsumeIntInRange(-1, 80),
                              num_new_tokens=fdp.ConsumeIntInRange(-1, 80), block_table=make_array(fdp, np.int32),
                              draft_tokens=make_array(fdp, np.int32) if fdp.ConsumeBool() else None,
                              is_prompt=[None, True, False][fdp.ConsumeIntInRange(0, 2)], params=params)
        fn = [E.prepare_prompt_v4, E.prepare_decode_v4, E.prepare_zos_inputs, E.prepare_decode_zos_inputs][target - 4]
        args = E.PrepareArgs(block_size=BS, max_model_len=48, **{k: v.copy() for k, v in h.bufs.items()})
        if target >= 6:
            fn(args, pool, h.args)
        else:
            fn(args, pool)
        E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
        args.zos_discard(make_array(fdp, np.int64))
    elif target == 8:
        table = make_array(fdp, np.int32)
        E.set_engram_lookup_table(table, fdp.ConsumeIntInRange(-1, 80))
        E.encode_compressed(make_array(fdp, np.int32), out=make_array(fdp, np.int32) if fdp.ConsumeBool() else None)
    elif target == 9:
        s.add_request(f"fz{fdp.ConsumeIntInRange(0, 10**6)}", make_array(fdp, np.int32), E.SamplingParams(stop_token_ids=make_array(fdp, np.int32), banned_token_ids=make_array(fdp, np.int32), max_tokens=fdp.ConsumeIntInRange(-1, 8), n=fdp.ConsumeIntInRange(-1, 3)))
    elif target == 10:
        E.FlopsEstimator(hidden_size=64, num_layers=2, num_attention_heads=4, intermediate_size=128,
                         vocab_size=100).step_flops(make_array(fdp, np.int64), make_array(fdp, np.int64),
                                                    fdp.ConsumeIntInRange(-1, 10))
    else:
        s.abort_request([f"r{fdp.ConsumeIntInRange(0, h.next_id + 2)}"])


def TestOneInput(data: bytes):
    fdp = atheris.FuzzedDataProvider(data)
    STATS["calls"] += 1
    try:
        call_one(fdp)
        STATS["accepted"] += 1
    except ALLOWED:
        STATS["rejected"] += 1
    except RuntimeError as e:
        if "Unable to cast" not in str(e):
            raise
        STATS["known_cast_bug"] += 1
    H.check()
    try:
        H.normal_update()            # the engine is still usable
    except ALLOWED:
        H.reset()                    # e.g. the fuzzer aborted everything mid-step; start clean
    H.check()
    if STATS["calls"] % 20000 == 0:
        print(f"#stats {STATS}", file=sys.stderr, flush=True)


def main():
    global H
    E.set_engram_lookup_table(None, 0)
    H = Harness()
    atheris.instrument_all() if os.environ.get("DEEPINFER_FUZZ_INSTRUMENT_ALL") else None
    atexit.register(lambda: print(f"#final {STATS}", file=sys.stderr, flush=True))
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

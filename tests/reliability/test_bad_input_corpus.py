"""Bad-input corpus for every public name of deepinfer._C.engine: wrong types, dtypes, shapes,
non-contiguous and read-only buffers, negative and huge sizes, NaN, out-of-range ids, calls in
the wrong state, and use after the owning object is gone.

Every case must raise a Python exception (never crash, hang or silently accept) and leave the
engine usable: after each case a normal step (schedule, inputs, sampler inputs, update, outputs)
runs on the same objects and the scheduler's invariants hold. A few "use after the owner is gone"
cases may also succeed (the engine keeps the owner alive); they must never crash — under
ASan/UBSan (the sanitize session) that includes reading freed memory.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from deepinfer._C import engine as E

VOCAB = 50
BS = 4
T, S, W = 64, 8, 16


def buffers(**over):
    b = dict(input_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
             slot_mapping=np.zeros(T, np.int64), query_start_loc=np.zeros(S + 1, np.int32),
             seq_lens=np.zeros(S, np.int32), block_tables=np.zeros((S, W), np.int32),
             logits_indices=np.zeros(T, np.int32), zos_source_index=np.zeros(T, np.int32))
    b.update(over)
    return b


def make_args(**over):
    kw = dict(block_size=BS, max_model_len=48, graph_batch_sizes=[1, 2, 4, 8])
    bufs = buffers(**{k: v for k, v in over.items() if k in buffers()})
    kw.update({k: v for k, v in over.items() if k not in bufs})
    return E.PrepareArgs(**kw, **bufs)


class World:
    """A scheduler with requests in several states and one step scheduled and prepared."""

    def __init__(self):
        self.sched = E.Scheduler(num_blocks=64, block_size=BS, max_num_seqs=S, max_num_batched_tokens=T,
                                 max_model_len=48, vocab_size=VOCAB, eos_token_id=1, num_lookahead_slots=2,
                                 watermark=0.0)
        self.out_pool = E.RequestOutputPool(max_size=16)
        self.args = make_args()
        self.pool = E.SequenceMetadataPool()
        self.si = E.SamplerInputs(generator_seed=3)
        self.sched.add_request("a", [5, 6, 7, 8, 9, 10], E.SamplingParams(max_tokens=6, prompt_logprobs=2))
        self.sched.add_request("b", [5, 6, 7, 8, 11], E.SamplingParams(max_tokens=6, temperature=0.5, presence_penalty=0.3))
        self.step(prepare=True)              # prefill
        self.sched.update(np.full(self.rows, 12, np.int32))
        E.build_request_outputs(self.sched, self.out_pool)
        self.step(prepare=True)              # a decode step, in flight

    def step(self, prepare):
        out = self.sched.schedule()
        self.rows = out.num_sample_rows
        if prepare:
            self.pool.build(self.sched)
            if out.num_decodes == len(out):
                E.prepare_decode_v4(self.args, self.pool)
            else:
                E.prepare_prompt_v4(self.args, self.pool)
            E.prepare_sampler_inputs(self.args, self.pool, self.si)
        return out

    def assert_usable(self):
        """A normal step after the bad call: the engine still works and is consistent."""
        if self.sched.step_in_flight:
            self.sched.update(np.full(self.rows, 13, np.int32))
        E.build_request_outputs(self.sched, self.out_pool)
        E.get_finished_seqs_info(self.sched)
        self.sched.add_request(f"after-{id(self)}", [7, 8, 9], E.SamplingParams(max_tokens=2))
        self.step(prepare=True)
        assert self.si.driver.num_real_rows == self.rows
        self.sched.update(np.full(self.rows, 14, np.int32))
        E.build_request_outputs(self.sched, self.out_pool)
        assert self.sched.check_invariants() == ""


@dataclass
class Case:
    name: str          # the public name it targets
    what: str
    call: Callable[[World], object]
    raises: tuple = (ValueError, TypeError)
    may_succeed: bool = False    # use-after-owner-gone: keeping the owner alive is also correct
    bug: str | None = None       # a reported bug: xfail(strict) until it is fixed


CASES: list[Case] = []


CORE_I = "reported in build/notes/requests-for-core-I.md"
CORE_II = "reported in build/notes/requests-for-core-II.md"


def case(name, what, raises=(ValueError, TypeError), may_succeed=False, bug=None):
    def deco(fn):
        CASES.append(Case(name, what, fn, raises, may_succeed, bug))
        return fn
    return deco


def ro(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


NAN = float("nan")
HUGE = 2**31
HUGE64 = 2**63

# ---------------------------------------------------------------- Scheduler
SCHED_KW = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=48,
                vocab_size=VOCAB)
for field, bad, exc in [
    ("num_blocks", -1, (ValueError,)), ("num_blocks", 0, (ValueError,)), ("num_blocks", HUGE, (TypeError, OverflowError)),
    ("num_blocks", "64", (TypeError,)), ("num_blocks", 64.0, (TypeError,)), ("block_size", 0, (ValueError,)),
    ("block_size", -4, (ValueError,)), ("max_num_seqs", 0, (ValueError,)), ("max_num_batched_tokens", -1, (ValueError,)),
    ("max_model_len", 0, (ValueError,)), ("vocab_size", 0, (ValueError,)), ("vocab_size", -5, (ValueError,)),
    ("eos_token_id", VOCAB, (ValueError,)), ("eos_token_id", -2, (ValueError,)), ("policy", "lifo", (ValueError,)),
    ("policy", None, (TypeError,)), ("watermark", NAN, (ValueError,)), ("watermark", -0.1, (ValueError,)),
    ("watermark", 1.5, (ValueError,)), ("long_prefill_token_threshold", -1, (ValueError,)),
    ("num_lookahead_slots", -1, (ValueError,)), ("num_state_slots", 3, (ValueError,)),
    ("num_state_slots", -1, (ValueError,)), ("hash_bits", 0, (ValueError,)), ("hash_bits", 65, (ValueError,)),
    # num_blocks=2**31-1 gets the process OOM-killed: a subprocess test with a memory limit in
    # test_regressions_core.py (reported bug), never here
]:
    case("Scheduler", f"{field}={bad!r}", exc)(lambda w, f=field, b=bad: E.Scheduler(**{**SCHED_KW, f: b}))
case("Scheduler", "missing vocab_size", (TypeError,))(lambda w: E.Scheduler(num_blocks=8))
case("Scheduler", "cache smaller than one max_model_len sequence", (ValueError,))(
    lambda w: E.Scheduler(**{**SCHED_KW, "num_blocks": 3}))

ADD_BAD = [
    ("empty prompt", dict(prompt_token_ids=[])), ("token out of vocab", dict(prompt_token_ids=[1, VOCAB])),
    ("negative token", dict(prompt_token_ids=[1, -1])), ("float tokens", dict(prompt_token_ids=[1.5, 2.0])),
    ("float array tokens", dict(prompt_token_ids=np.array([1.0, 2.0]))),
    ("string prompt", dict(prompt_token_ids="hello")), ("None prompt", dict(prompt_token_ids=None)),
    ("2-D prompt", dict(prompt_token_ids=np.ones((2, 2), np.int32))),
    ("huge token", dict(prompt_token_ids=[HUGE64])),
    ("temperature NaN", dict(temperature=NAN)), ("temperature < 0", dict(temperature=-1.0)),
    ("temperature inf", dict(temperature=math.inf)),
    ("top_p NaN", dict(top_p=NAN)), ("top_p 0", dict(top_p=0.0)), ("top_p > 1", dict(top_p=1.5)),
    ("top_k -2", dict(top_k=-2)), ("top_k 0", dict(top_k=0)), ("min_p NaN", dict(min_p=NAN)),
    ("min_p 2", dict(min_p=2.0)), ("presence NaN", dict(presence_penalty=NAN)),
    ("frequency inf", dict(frequency_penalty=math.inf)), ("repetition 0", dict(repetition_penalty=0.0)),
    ("repetition NaN", dict(repetition_penalty=NAN)), ("n 0", dict(n=0)), ("n > max_num_seqs", dict(n=S + 1)),
    ("n huge", dict(n=HUGE)), ("max_tokens 0", dict(max_tokens=0)), ("max_tokens -1", dict(max_tokens=-1)),
    ("min_tokens > max_tokens", dict(min_tokens=9, max_tokens=3)), ("min_tokens -1", dict(min_tokens=-1)),
    ("logprobs -1", dict(logprobs=-1)), ("prompt_logprobs -3", dict(prompt_logprobs=-3)),
    ("stop id out of vocab", dict(stop_token_ids=[VOCAB + 3])), ("stop ids string", dict(stop_token_ids="ab")),
    ("allowed out of vocab", dict(allowed_token_ids=[-1])), ("banned out of vocab", dict(banned_token_ids=[VOCAB])),
    ("logit_bias list", dict(logit_bias=[1, 2])), ("logit_bias bad key", dict(logit_bias={VOCAB: 1.0})),
    ("logit_bias NaN", dict(logit_bias={3: NAN})), ("logit_bias str key", dict(logit_bias={"a": 1.0})),
    ("output_kind", dict(output_kind="streaming")), ("eos out of vocab", dict(eos_token_id=VOCAB)),
    ("priority str", dict(priority="high")), ("seed str", dict(seed="s")), ("seed huge", dict(seed=2**70)),
]
ADD_BUGS: dict[str, str] = {}
for what, kw in ADD_BAD:
    def _add(w, kw=kw):
        kw = dict(kw)
        prompt = kw.pop("prompt_token_ids", [5, 6, 7])
        request_kw = {k: kw.pop(k) for k in ("output_kind", "eos_token_id", "priority") if k in kw}
        return w.sched.add_request("bad", prompt, E.SamplingParams(**kw), **request_kw)
    case("Scheduler", f"add_request {what}", bug=ADD_BUGS.get(what))(_add)
case("Scheduler", "add_request sampling keyword")(lambda w: w.sched.add_request("bad", [5, 6], temperature=0.5))
case("Scheduler", "add_request params dict")(lambda w: w.sched.add_request("bad", [5, 6], {"n": 1}))
case("Scheduler", "add_request bad word out of vocab")(
    lambda w: w.sched.add_request("bad", [5, 6], E.SamplingParams(bad_words_token_ids=[[5, VOCAB]])))

# ---------------------------------------------------------------- SamplingParams
SP_BAD = [
    ("positional", (1,), {}), ("unknown keyword", (), dict(colour=1)), ("n bool", (), dict(n=True)),
    ("n float", (), dict(n=1.0)), ("n huge", (), dict(n=HUGE)), ("temperature str", (), dict(temperature="1")),
    ("temperature numpy bool", (), dict(temperature=np.bool_(True))), ("temperature 1e300", (), dict(temperature=1e300)),
    ("temperature int too large", (), dict(temperature=10**400)), ("top_p 1e-50", (), dict(top_p=1e-50)),
    ("seed float", (), dict(seed=1.5)), ("seed huge", (), dict(seed=HUGE64)),
    ("stop ids int", (), dict(stop_token_ids=5)), ("stop ids bools", (), dict(stop_token_ids=[True])),
    ("stop ids float array", (), dict(stop_token_ids=np.array([1.5]))), ("stop ids 2-D", (), dict(stop_token_ids=[[1]])),
    ("stop ids dict", (), dict(stop_token_ids={1: 2})), ("stop ids set", (), dict(stop_token_ids={1, 2})),
    ("ignore_eos int", (), dict(ignore_eos=1)), ("logit_bias bool key", (), dict(logit_bias={True: 1.0})),
    ("logit_bias huge key", (), dict(logit_bias={HUGE64: 1.0})), ("logit_bias str value", (), dict(logit_bias={1: "x"})),
    ("allowed empty", (), dict(allowed_token_ids=[])), ("allowed str", (), dict(allowed_token_ids="12")),
    ("banned negative", (), dict(banned_token_ids=[-1])), ("bad words flat", (), dict(bad_words_token_ids=[1, 2])),
    ("bad words empty word", (), dict(bad_words_token_ids=[[]])), ("bad words str", (), dict(bad_words_token_ids="ab")),
    ("bad words negative", (), dict(bad_words_token_ids=[[1, -2]])), ("bad words None word", (), dict(bad_words_token_ids=[None])),
]
for what, args, kw in SP_BAD:
    case("SamplingParams", what)(lambda w, a=args, k=kw: E.SamplingParams(*a, **k))
case("SamplingParams", "assign min_tokens > max_tokens")(lambda w: setattr(E.SamplingParams(max_tokens=2), "min_tokens", 3))
case("SamplingParams", "assign unknown field", (AttributeError,))(lambda w: setattr(E.SamplingParams(), "temprature", 1.0))
case("SamplingParams", "replace bad value")(lambda w: E.SamplingParams().replace(top_k=0))
case("SamplingParams", "validate negative vocab")(lambda w: E.SamplingParams().validate(-1))
case("SamplingParams", "validate ids past vocab")(lambda w: E.SamplingParams(stop_token_ids=[VOCAB]).validate(VOCAB))
# (unpickling: __setstate__ on a bare instance; pybind11 ignores it on a constructed one)
case("SamplingParams", "setstate bad dict")(
    lambda w: E.SamplingParams.__new__(E.SamplingParams).__setstate__({"n": 0}))
case("SamplingParams", "setstate not a dict")(lambda w: E.SamplingParams.__new__(E.SamplingParams).__setstate__([1]))
case("Scheduler", "add_request duplicate id")(lambda w: w.sched.add_request("a", [5, 6]))
case("Scheduler", "add_request placeholder id")(lambda w: w.sched.add_request(E.PLACEHOLDER_REQUEST_ID, [5, 6]))
case("Scheduler", "add_request id not str")(lambda w: w.sched.add_request(7, [5, 6]))
case("Scheduler", "abort unknown id")(lambda w: w.sched.abort_request("nope"))
case("Scheduler", "abort list with an unknown id")(lambda w: w.sched.abort_request(["a", "nope"]))
case("Scheduler", "abort int")(lambda w: w.sched.abort_request(5))
case("Scheduler", "schedule while a step is in flight")(lambda w: w.sched.schedule())
# Any integer array is accepted (converted when not int32 C-contiguous): the bad ones here are the
# wide or strided arrays whose values are not vocabulary ids, and non-integer dtypes.
for what, arr in [("float32 tokens", np.zeros(2, np.float32)), ("bool tokens", np.zeros(2, bool)),
                  ("int64 token beyond int32", np.array([2**40, 3], np.int64)),
                  ("too few rows", np.zeros(1, np.int32)), ("too many rows", np.zeros(5, np.int32)),
                  ("2-D", np.zeros((2, 1), np.int32)),
                  ("non-contiguous out of vocab", np.array([VOCAB, 0, 3, 0], np.int32)[::2]),
                  ("token out of vocab", np.array([3, VOCAB], np.int32)), ("negative token", np.array([-1, 3], np.int32)),
                  ("list of floats", [1.5, 2.5]), ("None", None), ("str", "ab")]:
    case("Scheduler", f"update {what}")(lambda w, a=arr: w.sched.update(a))
case("Scheduler", "update logprobs float64")(
    lambda w: w.sched.update(np.zeros(2, np.int32), logprobs=np.zeros(2, np.float64)))
case("Scheduler", "update logprobs wrong length")(
    lambda w: w.sched.update(np.zeros(2, np.int32), logprobs=np.zeros(3, np.float32)))
case("Scheduler", "update topk ids without values")(
    lambda w: w.sched.update(np.zeros(2, np.int32), topk_token_ids=np.zeros((2, 2), np.int32)))
case("Scheduler", "update topk shape mismatch")(
    lambda w: w.sched.update(np.zeros(2, np.int32), topk_token_ids=np.zeros((2, 2), np.int32),
                             topk_logprobs=np.zeros((2, 3), np.float32)))
case("Scheduler", "update topk ids out of vocab")(lambda w: _topk_out_of_vocab())


def _topk_out_of_vocab():
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    s.add_request("x", [5, 6], E.SamplingParams(max_tokens=3, logprobs=2))       # top-k is read for this row
    s.schedule()
    s.update(np.zeros(1, np.int32), logprobs=np.zeros(1, np.float32), topk_token_ids=np.full((1, 2), VOCAB, np.int32),
             topk_logprobs=np.zeros((1, 2), np.float32))
case("Scheduler", "stop_sequence unknown seq")(lambda w: w.sched.stop_sequence(999, "x", 0))
case("Scheduler", "stop_sequence count > outputs")(lambda w: w.sched.stop_sequence(0, "x", 99))
case("Scheduler", "stop_sequence negative count")(lambda w: w.sched.stop_sequence(0, "x", -1))
case("Scheduler", "stop_sequence string not str")(lambda w: w.sched.stop_sequence(0, 5, 0))
case("Scheduler", "get_sequence unknown")(lambda w: w.sched.get_sequence(12345))
case("Scheduler", "get_sequence negative")(lambda w: w.sched.get_sequence(-1))
case("Scheduler", "get_sequence huge", (ValueError, TypeError, OverflowError))(lambda w: w.sched.get_sequence(HUGE64 * 4))
case("Scheduler", "get_sequences unknown")(lambda w: w.sched.get_sequences("nope"))

# ---------------------------------------------------------------- SchedulerOutputs / BlockManager
case("SchedulerOutputs", "constructed from Python")(lambda w: E.SchedulerOutputs())
case("SchedulerOutputs", "step is read-only", (AttributeError,))(lambda w: setattr(_outputs(w), "step", 3))
case("SchedulerOutputs", "read after its scheduler is gone", may_succeed=True)(lambda w: _orphan_outputs_obj())
case("BlockManager", "constructed from Python")(lambda w: E.BlockManager())
case("BlockManager", "ref_count out of range")(lambda w: w.sched.block_manager.ref_count(64))
case("BlockManager", "ref_count negative")(lambda w: w.sched.block_manager.ref_count(-1))
case("BlockManager", "is_cached out of range")(lambda w: w.sched.block_manager.is_cached(10**6))
case("BlockManager", "ref_count str")(lambda w: w.sched.block_manager.ref_count("0"))
case("BlockManager", "after its scheduler is gone", may_succeed=True)(lambda w: _orphan_block_manager())


def _outputs(w):
    # the in-flight step's outputs object (schedule() returns the same reused object)
    w.sched.update(np.full(w.rows, 13, np.int32))
    out = w.step(prepare=False)
    return out


def _orphan_outputs_obj():
    s = E.Scheduler(**SCHED_KW)
    s.add_request("x", [5, 6, 7], E.SamplingParams(max_tokens=3))
    out = s.schedule()
    del s
    gc.collect()
    return out.seq_ids.tolist(), out.request_ids, out.num_sample_rows, out.blocks_to_copy


def _orphan_block_manager():
    s = E.Scheduler(**SCHED_KW)
    bm = s.block_manager
    del s
    gc.collect()
    return bm.num_free_blocks + bm.ref_count(0)


# ---------------------------------------------------------------- Sequence / SequenceData / status
def _released_handle(w):
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    s.add_request("x", [5, 6], E.SamplingParams(max_tokens=1))
    s.schedule()
    seq = s.get_sequence(0)
    s.update(np.array([7], np.int32))
    s.schedule()                      # releases the finished request
    return seq.token_ids


def _orphan_sequence():
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    s.add_request("x", [5, 6], E.SamplingParams(max_tokens=3))
    seq, data = s.get_sequence(0), s.get_sequence(0).data
    del s
    gc.collect()
    return seq.token_ids, data.get_len()


case("Sequence", "constructed from Python")(lambda w: E.Sequence())
case("Sequence", "handle after its request was released")(_released_handle)
case("Sequence", "handle after its scheduler is gone", may_succeed=True)(lambda w: _orphan_sequence())
case("Sequence", "attribute is read-only", (AttributeError,))(lambda w: setattr(w.sched.get_sequence(0), "status", 0))
case("SequenceData", "constructed from Python")(lambda w: E.SequenceData())
case("SequenceData", "data of a released request")(lambda w: _released_data())


def _released_data():
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    s.add_request("x", [5, 6], E.SamplingParams(max_tokens=1))
    s.schedule()
    data = s.get_sequence(0).data
    s.update(np.array([7], np.int32))
    s.schedule()
    return data.token_ids


case("SequenceStatus", "value out of range")(lambda w: E.SequenceStatus(99))
case("SequenceStatus", "from str")(lambda w: E.SequenceStatus("RUNNING"))
case("PLACEHOLDER_REQUEST_ID", "request id refused by add_request")(
    lambda w: w.sched.add_request(E.PLACEHOLDER_REQUEST_ID, [3, 4]))

# ---------------------------------------------------------------- fork
case("clone_and_zero_states_and_blocks", "unknown seq")(lambda w: E.clone_and_zero_states_and_blocks(w.sched, 999, 1))
case("clone_and_zero_states_and_blocks", "zero children")(lambda w: _fork_after_update(w, 0))
case("clone_and_zero_states_and_blocks", "negative children")(lambda w: _fork_after_update(w, -3))
case("clone_and_zero_states_and_blocks", "more children than max_num_seqs")(lambda w: _fork_after_update(w, S + 1))
case("clone_and_zero_states_and_blocks", "huge children", (ValueError, TypeError, OverflowError))(
    lambda w: _fork_after_update(w, HUGE))
case("clone_and_zero_states_and_blocks", "scheduler not a Scheduler")(
    lambda w: E.clone_and_zero_states_and_blocks(w.pool, 0, 1))
case("clone_and_zero_states_and_blocks", "finished seq")(lambda w: _fork_finished(w))


def _fork_after_update(w, k):
    w.sched.update(np.full(w.rows, 13, np.int32))
    return E.clone_and_zero_states_and_blocks(w.sched, 0, k)


def _fork_finished(w):
    w.sched.update(np.full(w.rows, 13, np.int32))
    w.sched.abort_request("b")
    return E.clone_and_zero_states_and_blocks(w.sched, 1, 1)


# ---------------------------------------------------------------- outputs
case("RequestOutput", "constructed from Python")(lambda w: E.RequestOutput())
case("RequestOutput", "text set to a non-str", (TypeError,))(lambda w: _first_output(w).outputs[0].__setattr__("text", 5))
case("RequestOutput", "request_id read-only", (AttributeError,))(lambda w: setattr(_first_output(w), "request_id", "z"))
case("RequestOutputPool", "negative max_size")(lambda w: E.RequestOutputPool(max_size=-1))
case("RequestOutputPool", "max_size str")(lambda w: E.RequestOutputPool(max_size="8"))
case("RequestOutputPool", "max_size huge", (ValueError, TypeError, OverflowError))(lambda w: E.RequestOutputPool(max_size=HUGE64))
case("build_request_outputs", "while a step awaits update")(lambda w: E.build_request_outputs(w.sched, w.out_pool))
case("build_request_outputs", "pool of the wrong type")(lambda w: E.build_request_outputs(w.sched, w.pool))
case("build_request_outputs", "scheduler None")(lambda w: E.build_request_outputs(None, w.out_pool))
case("build_request_outputs", "outputs after their pool and scheduler are gone", may_succeed=True)(
    lambda w: _orphan_outputs())
case("get_finished_seqs_info", "scheduler of the wrong type")(lambda w: E.get_finished_seqs_info(w.out_pool))
case("get_finished_seqs_info", "no argument")(lambda w: E.get_finished_seqs_info())


def _first_output(w):
    w.sched.update(np.full(w.rows, 13, np.int32))
    outs = E.build_request_outputs(w.sched, w.out_pool)
    return outs[0]


def _orphan_outputs():
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    p = E.RequestOutputPool()
    s.add_request("x", [5, 6], E.SamplingParams(max_tokens=3, logprobs=1))
    s.schedule()
    s.update(np.array([7], np.int32), logprobs=np.zeros(1, np.float32), topk_token_ids=np.ones((1, 1), np.int32),
             topk_logprobs=np.zeros((1, 1), np.float32))
    outs = E.build_request_outputs(s, p)
    del s, p
    gc.collect()
    return [(o.request_id, o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_token_ids, o.metrics) for o in outs]


# ---------------------------------------------------------------- PrepareArgs
for buf, bad, what in [
    ("input_ids", np.zeros(T, np.int64), "dtype"), ("input_ids", np.zeros(T, np.float32), "float dtype"),
    ("input_ids", np.zeros((T, 1), np.int32), "2-D"), ("input_ids", np.zeros(2 * T, np.int32)[::2], "non-contiguous"),
    ("input_ids", ro(np.zeros(T, np.int32)), "read-only"), ("input_ids", np.zeros(0, np.int32), "empty"),
    ("input_ids", list(range(T)), "list"), ("input_ids", None, "None"),
    ("positions", np.zeros(T - 1, np.int32), "too small"), ("slot_mapping", np.zeros(T, np.int32), "int32 slots"),
    ("query_start_loc", np.zeros(S, np.int32), "too small"), ("seq_lens", np.zeros(S - 1, np.int32), "too small"),
    ("block_tables", np.zeros(S * W, np.int32), "1-D"), ("block_tables", np.zeros((S, 2 * W), np.int32)[:, ::2], "strided"),
    ("block_tables", np.asfortranarray(np.zeros((S, W), np.int32)), "Fortran order"),
    ("block_tables", ro(np.zeros((S, W), np.int32)), "read-only"), ("logits_indices", np.zeros(T, np.uint32), "uint32"),
    ("zos_source_index", np.zeros(T - 1, np.int32), "too small"), ("seq_lens", np.zeros(S, np.int32).byteswap().view(
        np.dtype(">i4")), "big-endian"),
]:
    case("PrepareArgs", f"{buf} {what}")(lambda w, b=buf, x=bad: make_args(**{b: x}))
for kw, what in [(dict(block_size=0), "block_size 0"), (dict(block_size=-16), "block_size < 0"),
                 (dict(max_model_len=0), "max_model_len 0"), (dict(graph_batch_sizes=[0]), "graph size 0"),
                 (dict(graph_batch_sizes=[S + 1]), "graph size > S"), (dict(graph_batch_sizes=[1.5]), "graph size float"),
                 (dict(graph_batch_sizes="12"), "graph sizes str"),
                 (dict(yoco_mode=E.YocoPrefillTruncationMode.LAST_TOKEN), "YOCO without its buffers"),
                 (dict(engram_ngram_orders=[2], engram_layer_seeds=[1], engram_table_sizes=[97]), "Engram without buffer"),
                 (dict(engram_ngram_orders=[17], engram_layer_seeds=[1], engram_table_sizes=[97],
                       engram_indices=np.zeros((T, 1), np.int32)), "Engram order 17"),
                 (dict(engram_ngram_orders=[2], engram_layer_seeds=[-1], engram_table_sizes=[97],
                       engram_indices=np.zeros((T, 1), np.int32)), "Engram seed < 0"),
                 (dict(engram_ngram_orders=[2], engram_layer_seeds=[1], engram_table_sizes=[0],
                       engram_indices=np.zeros((T, 1), np.int32)), "Engram table size 0"),
                 (dict(engram_ngram_orders=[2], engram_layer_seeds=[1], engram_table_sizes=[97],
                       engram_indices=np.zeros((T, 3), np.int32)), "Engram buffer width"),
                 (dict(yoco_mode=3), "yoco_mode int")]:
    case("PrepareArgs", what)(lambda w, k=kw: make_args(**k))
case("PrepareArgs", "zos_discard with floats")(lambda w: w.args.zos_discard([1.5]))
case("PrepareArgs", "zos_discard with a string")(lambda w: w.args.zos_discard("ab"))
case("PrepareArgs", "buffers dropped by the caller", may_succeed=True)(lambda w: _args_after_buffers_gone(w))


def _args_after_buffers_gone(w):
    args = make_args()          # its numpy buffers have no other reference
    gc.collect()
    w.sched.update(np.full(w.rows, 13, np.int32))
    E.build_request_outputs(w.sched, w.out_pool)
    w.step(prepare=False)
    w.pool.build(w.sched)
    return E.prepare_decode_v4(args, w.pool)


# ---------------------------------------------------------------- builders
def _fresh_pool_rows(**over):
    p = E.SequenceMetadataPool()
    kw = dict(seq_id=1, request_id="r", token_ids=[3, 4, 5, 6], num_prompt_tokens=4, num_computed_tokens=0,
              num_new_tokens=4, block_table=[0])
    kw.update(over)
    # the sampling fields go in the row's SamplingParams (a bad one is refused there)
    fields = {k: kw.pop(k) for k in list(kw) if k in E.SamplingParams.FIELDS}
    p.add_sequence(**kw, params=E.SamplingParams(**fields) if fields else None)
    return p


for name in ("prepare_prompt_v4", "prepare_decode_v4"):
    fn = getattr(E, name)
    case(name, "args None")(lambda w, f=fn: f(None, w.pool))
    case(name, "metadata of the wrong type")(lambda w, f=fn: f(w.args, w.sched))
    case(name, "block table too short")(lambda w, f=fn: f(w.args, _fresh_pool_rows(num_computed_tokens=8,
                                                                                     num_new_tokens=1, token_ids=[3] * 9,
                                                                                     num_prompt_tokens=8)))
    case(name, "token range past the tokens")(lambda w, f=fn: f(w.args, _fresh_pool_rows(num_computed_tokens=3,
                                                                                           num_new_tokens=5)))
    case(name, "too many tokens for T")(lambda w, f=fn: f(w.args, _fresh_pool_rows(
        token_ids=[3] * (T + 1), num_prompt_tokens=T + 1, num_new_tokens=T + 1 if "prompt" in f.__name__ else 1,
        num_computed_tokens=0 if "prompt" in f.__name__ else T, block_table=list(range(W)))))
    case(name, "block table wider than W")(lambda w, f=fn: f(w.args, _fresh_pool_rows(block_table=list(range(W + 1)))))
    case(name, "pool built from a scheduler that is gone", may_succeed=True)(lambda w, f=fn: _pool_orphan(w, f))
case("prepare_decode_v4", "a prompt row")(lambda w: E.prepare_decode_v4(w.args, _fresh_pool_rows()))
case("prepare_prompt_v4", "context beyond max_model_len")(lambda w: E.prepare_prompt_v4(
    w.args, _fresh_pool_rows(token_ids=[3] * 50, num_prompt_tokens=50, num_new_tokens=10, num_computed_tokens=40,
                             block_table=list(range(13)))))
for name in ("prepare_zos_inputs", "prepare_decode_zos_inputs"):
    fn = getattr(E, name)
    case(name, "args without zos_source_index")(lambda w, f=fn: f(_args_no_zos(), w.pool, w.args))
    case(name, "prev None")(lambda w, f=fn: f(w.args, w.pool, None))
    case(name, "prev of the wrong type")(lambda w, f=fn: f(w.args, w.pool, w.pool))
    case(name, "rows exceed S")(lambda w, f=fn: f(w.args, _many_rows(S + 1), w.args))


def _args_no_zos():
    b = buffers()
    del b["zos_source_index"]
    return E.PrepareArgs(block_size=BS, max_model_len=48, **b)


def _many_rows(n):
    p = E.SequenceMetadataPool()
    for i in range(n):
        p.add_sequence(seq_id=100 + i, request_id=f"m{i}", token_ids=[3, 4, 5], num_prompt_tokens=2,
                       num_computed_tokens=2, num_new_tokens=1, block_table=[i])
    return p


def _pool_orphan(w, fn):
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    s.add_request("x", [5, 6, 7], E.SamplingParams(max_tokens=3))
    s.schedule()
    p = E.SequenceMetadataPool()
    p.build(s)
    del s
    gc.collect()
    return fn(make_args(), p)


# ---------------------------------------------------------------- metadata pool
POOL_BAD = [
    ("token_ids floats", dict(token_ids=[1.5, 2.5])), ("token_ids str", dict(token_ids="abc")),
    ("negative token", dict(token_ids=[-1, 3, 4, 5])), ("num_prompt_tokens > tokens", dict(num_prompt_tokens=9)),
    ("num_prompt_tokens 0", dict(num_prompt_tokens=0)), ("num_computed negative", dict(num_computed_tokens=-1)),
    ("num_new_tokens 0", dict(num_new_tokens=0)), ("num_new_tokens negative", dict(num_new_tokens=-2)),
    ("num_new_tokens huge", dict(num_new_tokens=HUGE)), ("block_table floats", dict(block_table=[0.5])),
    ("block_table negative", dict(block_table=[-1])), ("draft_tokens floats", dict(draft_tokens=[1.5])),
    ("temperature NaN", dict(temperature=NAN)), ("top_p 0", dict(top_p=0.0)), ("top_k -5", dict(top_k=-5)),
    ("min_p NaN", dict(min_p=NAN)), ("repetition_penalty -1", dict(repetition_penalty=-1.0)),
    ("logprobs -2", dict(logprobs=-2)), ("logit_bias NaN", dict(logit_bias={3: NAN})),
    ("logit_bias list", dict(logit_bias=[3])), ("stop_token_ids floats", dict(stop_token_ids=[1.5])),
    ("seed str", dict(seed="x")), ("request_id int", dict(request_id=5)), ("unknown keyword", dict(colour=3)),
    ("2-D token_ids", dict(token_ids=np.ones((2, 2), np.int32))),
]
POOL_BUGS: dict[str, str] = {}
for what, kw in POOL_BAD:
    case("SequenceMetadataPool", f"add_sequence {what}", bug=POOL_BUGS.get(what))(lambda w, k=kw: _fresh_pool_rows(**k))
case("SequenceMetadataPool", "build from a non-Scheduler")(lambda w: E.SequenceMetadataPool().build(w.args))
case("SequenceMetadataPool", "build with no step scheduled")(lambda w: _build_unscheduled())
case("SequenceMetadataPool", "index out of range", (IndexError, ValueError))(lambda w: w.pool[99])
case("SequenceMetadataPool", "negative index past the start", (IndexError, ValueError))(lambda w: w.pool[-99])
case("SequenceMetadataPool", "index str")(lambda w: w.pool["a"])
case("SequenceMetadata", "constructed from Python")(lambda w: E.SequenceMetadata())
case("SequenceMetadata", "snapshot field is read-only", (AttributeError,))(lambda w: setattr(w.pool[0], "seq_id", 3))


def _build_unscheduled():
    s = E.Scheduler(**SCHED_KW)
    return E.SequenceMetadataPool().build(s)


# ---------------------------------------------------------------- sampler inputs
case("prepare_sampler_inputs", "out of the wrong type")(lambda w: E.prepare_sampler_inputs(w.args, w.pool, w.pool))
case("prepare_sampler_inputs", "metadata changed since the prepare call")(
    lambda w: E.prepare_sampler_inputs(w.args, _fresh_pool_rows(), w.si))
case("prepare_sampler_inputs", "args never prepared")(lambda w: E.prepare_sampler_inputs(make_args(), w.pool, w.si))
case("SamplerInputs", "generator_seed negative", (ValueError, TypeError, OverflowError))(
    lambda w: E.SamplerInputs(generator_seed=-1))
case("SamplerInputs", "generator_seed str")(lambda w: E.SamplerInputs(generator_seed="0"))
case("SamplerInputs", "generator_seed huge", (ValueError, TypeError, OverflowError))(
    lambda w: E.SamplerInputs(generator_seed=2**70))
case("SamplerInputs", "penalty_counts unknown")(lambda w: E.SamplerInputs(penalty_counts="sparse"))
case("SamplerInputs", "penalty_counts not a str")(lambda w: E.SamplerInputs(penalty_counts=1))
case("SamplerInputs", "penalty_counts positional")(lambda w: E.SamplerInputs(0, "full"))
for part in ("SamplingKernelInputs", "LogitsTransformInputs", "PrefillSamplingInputs", "DecodeSamplingInputs",
             "DriverSamplingInputs", "SpeculativeSamplingInputs", "PromptLogprobInputs"):
    case(part, "constructed from Python")(lambda w, p=part: getattr(E, p)())
    case(part, "views after their SamplerInputs is gone", may_succeed=True)(lambda w, p=part: _orphan_part(w, p))
case("DriverSamplingInputs", "seq_ids attribute read-only", (AttributeError,))(
    lambda w: setattr(w.si.driver, "seq_ids", np.zeros(2, np.int64)))


PART_ATTR = {"SamplingKernelInputs": "kernel", "LogitsTransformInputs": "transform", "PrefillSamplingInputs": "prefill",
             "DecodeSamplingInputs": "decode", "DriverSamplingInputs": "driver",
             "SpeculativeSamplingInputs": "speculative", "PromptLogprobInputs": "prompt_logprobs"}


def _orphan_part(w, part):
    si = E.SamplerInputs()
    E.prepare_sampler_inputs(w.args, w.pool, si)
    obj = getattr(si, PART_ATTR[part])
    arrays = {k: getattr(obj, k) for k in dir(obj) if not k.startswith("_")}
    del si
    gc.collect()
    return [np.asarray(v).sum() for v in arrays.values() if isinstance(v, np.ndarray)]


# ---------------------------------------------------------------- speculative, prompt logprobs
MTP = E.process_MTPInfo
for what, call in [
    ("num_accepted float32", lambda w: MTP(w.sched, np.zeros(w.rows, np.float32), np.zeros((w.rows, 1), np.int32))),
    ("num_accepted wrong length", lambda w: MTP(w.sched, np.zeros(w.rows + 1, np.int32), np.zeros((w.rows, 1), np.int32))),
    ("accepted > drafts", lambda w: MTP(w.sched, np.ones(w.rows, np.int32), np.zeros((w.rows, 2), np.int32))),
    ("accepted negative", lambda w: MTP(w.sched, np.full(w.rows, -1, np.int32), np.zeros((w.rows, 1), np.int32))),
    ("output_tokens 1-D", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros(w.rows, np.int32))),
    ("output_tokens 0 columns", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros((w.rows, 0), np.int32))),
    ("output_tokens out of vocab", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.full((w.rows, 1), VOCAB, np.int32))),
    ("output_tokens non-contiguous", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32),
                                                   np.zeros((w.rows, 4), np.int32)[:, ::2])),
    ("output_tokens int64", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros((w.rows, 1), np.int64))),
    ("next_drafts wrong rows", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros((w.rows, 1), np.int32),
                                             np.zeros((w.rows + 1, 2), np.int32))),
    ("next_drafts out of vocab", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros((w.rows, 1), np.int32),
                                               np.full((w.rows, 2), -4, np.int32))),
    ("logprobs shape", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros((w.rows, 1), np.int32), None,
                                     np.zeros((w.rows, 2), np.float32))),
    ("logprobs float64", lambda w: MTP(w.sched, np.zeros(w.rows, np.int32), np.zeros((w.rows, 1), np.int32), None,
                                       np.zeros((w.rows, 1), np.float64))),
    ("no step in flight", lambda w: (w.sched.update(np.full(w.rows, 13, np.int32)),
                                     MTP(w.sched, np.zeros(0, np.int32), np.zeros((0, 1), np.int32)))),
    ("scheduler None", lambda w: MTP(None, np.zeros(w.rows, np.int32), np.zeros((w.rows, 1), np.int32))),
]:
    case("process_MTPInfo", what)(call)


def _plp_step():
    """A scheduler with one prompt-logprob prefill step prepared: (sched, si, rows)."""
    s = E.Scheduler(**SCHED_KW, eos_token_id=1)
    s.add_request("p", [5, 6, 7, 8, 9], E.SamplingParams(max_tokens=2, prompt_logprobs=2))
    s.schedule()
    pool = E.SequenceMetadataPool()
    pool.build(s)
    args = make_args()
    E.prepare_prompt_v4(args, pool)
    si = E.prepare_sampler_inputs(args, pool, E.SamplerInputs())
    return s, si, si.prompt_logprobs.num_rows


ULP = E.update_prompt_logprobs
for what, call in [
    ("logprobs float64", lambda s, si, n: ULP(s, si, np.zeros(n, np.float64))),
    ("logprobs too short", lambda s, si, n: ULP(s, si, np.zeros(n - 1, np.float32))),
    ("logprobs 2-D", lambda s, si, n: ULP(s, si, np.zeros((n, 1), np.float32))),
    ("topk ids without values", lambda s, si, n: ULP(s, si, np.zeros(n, np.float32), np.zeros((n, 2), np.int32))),
    ("topk shapes differ", lambda s, si, n: ULP(s, si, np.zeros(n, np.float32), np.zeros((n, 2), np.int32),
                                                np.zeros((n, 3), np.float32))),
    ("sampler inputs of the wrong type", lambda s, si, n: ULP(s, s, np.zeros(n, np.float32))),
    ("twice for the same chunk", lambda s, si, n: (ULP(s, si, np.zeros(n, np.float32)),
                                                   ULP(s, si, np.zeros(n, np.float32)))),
]:
    case("update_prompt_logprobs", what)(lambda w, c=call: c(*_plp_step()))
case("update_prompt_logprobs", "topk ids out of vocab")(
    lambda w: (lambda s, si, n: ULP(s, si, np.zeros(n, np.float32), np.full((n, 2), VOCAB, np.int32),
                                    np.zeros((n, 2), np.float32)))(*_plp_step()))

# ---------------------------------------------------------------- Engram, YOCO, FLOPs
case("set_engram_lookup_table", "length != vocab_size")(lambda w: E.set_engram_lookup_table(np.arange(5, dtype=np.int32), 6))
case("set_engram_lookup_table", "value out of range")(lambda w: E.set_engram_lookup_table(np.array([0, 9], np.int32), 2))
case("set_engram_lookup_table", "negative value")(lambda w: E.set_engram_lookup_table(np.array([0, -1], np.int32), 2))
case("set_engram_lookup_table", "float table")(lambda w: E.set_engram_lookup_table(np.array([0.0, 1.0]), 2))
case("set_engram_lookup_table", "vocab_size 0")(lambda w: E.set_engram_lookup_table(np.zeros(0, np.int32), 0))
case("set_engram_lookup_table", "vocab_size negative")(lambda w: E.set_engram_lookup_table([0], -1))
case("set_engram_lookup_table", "str table")(lambda w: E.set_engram_lookup_table("ab", 2))
case("encode_compressed", "id outside the table")(lambda w: _with_table(lambda: E.encode_compressed([0, 99])))
case("encode_compressed", "negative id")(lambda w: _with_table(lambda: E.encode_compressed([-1])))
case("encode_compressed", "float ids")(lambda w: _with_table(lambda: E.encode_compressed([0.5])))
case("encode_compressed", "out too small")(lambda w: _with_table(lambda: E.encode_compressed([0, 1],
                                                                                             out=np.zeros(1, np.int32))))
case("encode_compressed", "out read-only")(lambda w: _with_table(lambda: E.encode_compressed([0, 1],
                                                                                             out=ro(np.zeros(2, np.int32)))))
case("encode_compressed", "out int64")(lambda w: _with_table(lambda: E.encode_compressed([0, 1],
                                                                                          out=np.zeros(2, np.int64))))
case("encode_compressed", "out non-contiguous")(lambda w: _with_table(lambda: E.encode_compressed(
    [0, 1], out=np.zeros(4, np.int32)[::2])))
case("encode_compressed", "no table installed")(lambda w: (E.set_engram_lookup_table(None, 0),
                                                           E.encode_compressed([0])))


def _with_table(fn):
    E.set_engram_lookup_table(np.array([0, 0, 1, 1], np.int32), 4)
    try:
        return fn()
    finally:
        E.set_engram_lookup_table(None, 0)


case("YocoPrefillTruncationMode", "PrepareArgs with an out-of-range mode")(
    lambda w: make_args(yoco_mode=E.YocoPrefillTruncationMode(7), yoco_kept_rows=np.zeros(T, np.int32),
                        yoco_cu_seqlens=np.zeros(S + 1, np.int32)))
case("YocoPrefillTruncationMode", "from str")(lambda w: E.YocoPrefillTruncationMode("NONE"))
FLOPS_KW = dict(hidden_size=64, num_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100)
for kw, what in [(dict(hidden_size=0), "hidden 0"), (dict(hidden_size=-64), "hidden < 0"),
                 (dict(num_attention_heads=3), "hidden not divisible by heads"), (dict(num_kv_heads=3), "kv heads"),
                 (dict(num_experts=4, num_experts_per_tok=5), "top-k > experts"), (dict(num_layers=HUGE64 * 2), "huge layers"),
                 (dict(sliding_layers=[5]), "sliding layer out of range"), (dict(hidden_size=64.0), "float hidden")]:
    case("FlopsEstimator", what, (ValueError, TypeError, OverflowError))(lambda w, k=kw: E.FlopsEstimator(**{**FLOPS_KW, **k}))
case("FlopsEstimator", "step_flops lengths differ")(lambda w: E.FlopsEstimator(**FLOPS_KW).step_flops([1, 2], [3], 1))
case("FlopsEstimator", "step_flops negative")(lambda w: E.FlopsEstimator(**FLOPS_KW).step_flops([-1], [3], 1))
case("FlopsEstimator", "step_flops floats")(lambda w: E.FlopsEstimator(**FLOPS_KW).step_flops([1.5], [3], 1))
case("FlopsEstimator", "attention_flops negative")(lambda w: E.FlopsEstimator(**FLOPS_KW).attention_flops(-3))
case("FlopsEstimator", "chunk query > context")(lambda w: E.FlopsEstimator(**FLOPS_KW).chunk_attention_flops(9, 3))


# ---------------------------------------------------------------- the tests
def test_corpus_covers_every_public_name():
    covered = {c.name for c in CASES}
    assert set(E.__all__) - covered == set(), sorted(set(E.__all__) - covered)
    assert covered <= set(E.__all__), covered - set(E.__all__)
    assert len(E.__all__) == 35  # the seed's 34 names + SamplingParams
    assert len(CASES) >= 250, len(CASES)


def _params():
    for i, c in enumerate(CASES):
        marks = [pytest.mark.xfail(strict=True, reason=c.bug)] if c.bug else []
        yield pytest.param(c, id=f"{i:03d}-{c.name}-{c.what}", marks=marks)


@pytest.mark.parametrize("c", list(_params()))
def test_bad_input_raises_and_engine_stays_usable(c: Case):
    w = World()
    if c.may_succeed:
        try:
            c.call(w)
        except (ValueError, TypeError, RuntimeError, AttributeError):
            pass
    else:
        with pytest.raises(c.raises):
            c.call(w)
    w.assert_usable()

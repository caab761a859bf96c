"""Bad input gets a Python exception naming the argument and the value; a rejected call changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_request, make_scheduler, run_step
from deepinfer_engine import _engine as E


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_blocks=0), "num_blocks: 0"),
        (dict(block_size=0), "block_size: 0"),
        (dict(policy="lifo"), "policy: 'lifo'"),
        (dict(watermark=1.5), "watermark"),
        (dict(num_state_slots=3), "num_state_slots: 3"),
        (dict(hash_bits=0), "hash_bits: 0"),
        (dict(num_blocks=4, max_model_len=64), "num_blocks: 4"),
        (dict(eos_token_id=100), "eos_token_id: 100"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=8), "max_num_batched_tokens: 8"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold: -1"),
        (dict(num_lookahead_slots=-2), "num_lookahead_slots: -2"),
    ],
)
def test_scheduler_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make_scheduler(**kw)


@pytest.mark.parametrize(
    "prompt, kw, exc, match",
    [
        ([2, 100], {}, ValueError, "prompt_token_ids.*100"),
        ([2, -1], {}, ValueError, "prompt_token_ids.*-1"),
        ([], {}, ValueError, "prompt_token_ids: must not be empty"),
        ([2.5], {}, TypeError, "prompt_token_ids"),
        (np.array([1.0, 2.0]), {}, TypeError, "prompt_token_ids"),
        ([2], dict(temperature=-0.5), ValueError, "temperature: -0.5"),
        ([2], dict(top_p=0.0), ValueError, "top_p: 0"),
        ([2], dict(top_p=1.5), ValueError, "top_p: 1.5"),
        ([2], dict(top_k=-2), ValueError, "top_k: -2"),
        ([2], dict(top_k=0), ValueError, "top_k: 0"),
        ([2], dict(min_p=2.0), ValueError, "min_p: 2"),
        ([2], dict(n=0), ValueError, "n: 0"),
        ([2], dict(n=9), ValueError, "n: 9"),
        ([2], dict(max_tokens=0), ValueError, "max_tokens: 0"),
        ([2], dict(max_tokens=3, min_tokens=4), ValueError, "min_tokens: 4"),
        ([2], dict(repetition_penalty=0.0), ValueError, "repetition_penalty: 0"),
        ([2], dict(presence_penalty=3.0), ValueError, "presence_penalty: 3"),
        ([2], dict(logprobs=-3), ValueError, "logprobs: -3"),
        ([2], dict(stop_token_ids=[5, 200]), ValueError, "stop_token_ids.*200"),
        ([2], dict(banned_token_ids=[-4]), ValueError, "banned_token_ids.*-4"),
        ([2], dict(allowed_token_ids=[]), ValueError, "allowed_token_ids"),
        ([2], dict(logit_bias={300: 1.0}), ValueError, "logit_bias.*300"),
        ([2], dict(logit_bias=[(1, 2.0)]), TypeError, "logit_bias"),
        ([2], dict(output_kind="streaming"), ValueError, "output_kind: 'streaming'"),
        ([2], dict(eos_token_id=1000), ValueError, "eos_token_id: 1000"),
    ],
)
def test_add_request_errors_leave_state_unchanged(prompt, kw, exc, match):
    s = make_scheduler()
    s.add_request("first", [2, 3])
    with pytest.raises(exc, match=match):
        add_request(s, "x", prompt, **kw)
    assert s.num_waiting == 1 and s.num_unfinished_requests == 1
    s.add_request("x", [2, 3])  # the id was not taken by the rejected call
    assert s.num_waiting == 2


def test_duplicate_and_unknown_request_ids():
    s = make_scheduler()
    s.add_request("a", [2])
    with pytest.raises(ValueError, match="request_id: 'a' is already in use"):
        s.add_request("a", [3])
    with pytest.raises(ValueError, match="unknown request id 'zzz'"):
        s.abort_request("zzz")
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        s.abort_request(["a", "nope"])
    assert s.get_sequences("a")[0].status == E.SequenceStatus.WAITING  # 'a' was not aborted
    with pytest.raises(ValueError, match="request_id"):
        s.get_sequences("nope")


def test_update_buffer_validation_and_state_unchanged():
    s = make_scheduler()
    s.add_request("a", [2, 3], E.SamplingParams(max_tokens=4, logprobs=2))
    s.add_request("b", [4, 5], E.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="no scheduled step"):
        s.update(np.zeros(2, np.int32))
    out = s.schedule()
    with pytest.raises(ValueError, match="waiting for update"):
        s.schedule()
    bad = [
        (np.zeros(2, np.float64), TypeError, "sampled_token_ids: expected integer token ids, got dtype float64"),
        ([5.0, 5], TypeError, "sampled_token_ids"),
        (np.zeros(3, np.int32), ValueError, r"sampled_token_ids: expected 2 elements"),
        (np.zeros((2, 1), np.int32), ValueError, r"sampled_token_ids: expected 2 elements, got shape \(2, 1\)"),
        (np.array([5, 100], np.int32), ValueError, "token id 100 at row 1"),
        (np.array([5, 2**33], np.int64), ValueError, "token id 8589934592 at row 1"),
    ]
    for arr, exc, match in bad:
        with pytest.raises(exc, match=match):
            s.update(arr)
    ok = np.array([5, 6], np.int32)
    with pytest.raises(TypeError, match="logprobs: expected dtype float32"):
        s.update(ok, logprobs=np.zeros(2, np.float64))
    with pytest.raises(ValueError, match="asks for 2 logprobs but k = 1"):
        s.update(
            ok,
            topk_token_ids=np.zeros((2, 1), np.int32),
            topk_logprobs=np.zeros((2, 1), np.float32),
        )
    with pytest.raises(ValueError, match="topk_token_ids"):
        s.update(ok, topk_token_ids=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="topk_token_ids: shapes"):
        s.update(
            ok,
            topk_token_ids=np.zeros((2, 2), np.int32),
            topk_logprobs=np.zeros((2, 3), np.float32),
        )
    # Nothing changed: the step is still in flight and a correct update applies once.
    assert s.step_in_flight and s.get_sequence(0).num_computed_tokens == 0
    s.update(
        ok, topk_token_ids=np.zeros((2, 2), np.int32), topk_logprobs=np.zeros((2, 2), np.float32)
    )
    assert s.get_sequence(0).output_token_ids.tolist() == [5] and s.check_invariants() == ""
    del out


def test_sequence_and_fork_errors():
    s = make_scheduler(max_num_seqs=2)
    a = s.add_request("a", [2, 3], E.SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="seq_id: 99"):
        s.get_sequence(99)
    with pytest.raises(ValueError, match="seq_id: .* is not running"):
        E.clone_and_zero_states_and_blocks(s, a, 1)
    out = s.schedule()
    s.update(np.full(out.num_sample_rows, 5, np.int32))
    with pytest.raises(ValueError, match="num_children: 0"):
        E.clone_and_zero_states_and_blocks(s, a, 0)
    with pytest.raises(ValueError, match="num_children: 2 exceeds"):
        E.clone_and_zero_states_and_blocks(s, a, 2)
    with pytest.raises(ValueError, match="num_output_tokens: 5"):
        s.stop_sequence(a, "x", 5)
    with pytest.raises(ValueError, match="seq_id: 77"):
        s.stop_sequence(77, "x", 0)
    with pytest.raises(ValueError, match="block: 1000"):
        s.block_manager.ref_count(1000)
    assert s.check_invariants() == ""
    with pytest.raises(TypeError):
        E.BlockManager()


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(n=1.5), TypeError, "n: expected int, got float"),
        (dict(ignore_eos=1), TypeError, "ignore_eos: expected bool, got int"),
        (dict(top_p="x"), TypeError, "top_p: expected float, got str"),
        (dict(output_kind=3), TypeError, "output_kind: expected str, got int"),
        (dict(max_tokens=2**40), ValueError, "max_tokens: 1099511627776 is out of the int32 range"),
        (dict(temprature=0.5), TypeError, "unexpected keyword argument 'temprature'"),
        (dict(priority=True), TypeError, "priority: expected int, got bool"),
        (dict(priority=2**31), ValueError, "priority: 2147483648 is out of the int32 range"),
    ],
)
def test_add_request_keyword_types(kw, exc, match):
    s = make_scheduler()
    with pytest.raises(exc, match=match):
        add_request(s, "a", [2], **kw)
    assert s.num_waiting == 0
    # None and ints for floats are accepted
    s.add_request("a", [2], E.SamplingParams(seed=None, logprobs=None, prompt_logprobs=None, temperature=0, top_p=1),
                  eos_token_id=None, arrival_time=None)


def test_add_request_takes_its_sampling_parameters_as_one_object():
    s = make_scheduler()
    with pytest.raises(TypeError, match="'temperature': sampling parameters go in a SamplingParams"):
        s.add_request("a", [2], temperature=0.5)
    with pytest.raises(TypeError, match="params: expected a deepinfer._C.engine.SamplingParams or None, got dict"):
        s.add_request("a", [2], {"temperature": 0.5})
    assert s.num_waiting == 0
    p = E.SamplingParams(max_tokens=3, stop_token_ids=[5])
    s.add_request("a", [2], p, priority=4, output_kind="delta")
    p.max_tokens = 9  # the scheduler keeps its own copy
    assert s.get_sequences("a")[0].priority == 4
    seq = s.get_sequences("a")[0]
    steps = 0
    while s.has_unfinished_requests():
        run_step(s)
        steps += 1
    assert steps == 3 and len(seq.output_token_ids) == 3  # the copy's max_tokens, not 9


def test_arrival_time_must_be_finite():
    s = make_scheduler()
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="arrival_time"):
            s.add_request("a", [2, 3], arrival_time=bad)
    assert not s.has_unfinished_requests()

"""RequestOutput / RequestOutputPool / build_request_outputs / get_finished_seqs_info."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from conftest import make_scheduler
from deepinfer_engine import _engine as E


def step(s, tokens, **kw):
    out = s.schedule()
    assert out.num_sample_rows == len(tokens)
    s.update(np.asarray(tokens, dtype=np.int32), **kw)


def test_cumulative_delta_and_final_only():
    s = make_scheduler()
    pool = E.RequestOutputPool()
    s.add_request("cum", [2, 3], E.SamplingParams(max_tokens=3), output_kind="cumulative")
    s.add_request("dlt", [4, 5], E.SamplingParams(max_tokens=3), output_kind="delta")
    s.add_request("fin", [6, 7], E.SamplingParams(max_tokens=3), output_kind="final_only")
    seen = {"cum": [], "dlt": [], "fin": []}
    for toks in ([11, 21, 31], [12, 22, 32], [13, 23, 33]):
        step(s, toks)
        for o in E.build_request_outputs(s, pool):
            seen[o.request_id].append(
                (o.outputs[0].token_ids, o.finished, o.outputs[0].finish_reason)
            )
    assert seen["cum"] == [
        ([11], False, None),
        ([11, 12], False, None),
        ([11, 12, 13], True, "length"),
    ]
    assert seen["dlt"] == [([21], False, None), ([22], False, None), ([23], True, "length")]
    assert seen["fin"] == [([31, 32, 33], True, "length")]
    # Nothing new: no outputs.
    assert E.build_request_outputs(s, pool) == []


def test_request_output_fields_and_metrics():
    s = make_scheduler()
    t0 = time.time()
    s.add_request("a", [2, 3, 4], E.SamplingParams(max_tokens=2, logprobs=2), arrival_time=t0 - 1.0)
    s.schedule()
    s.update(
        np.array([9], np.int32),
        logprobs=np.array([-0.5], np.float32),
        topk_token_ids=np.array([[9, 8]], np.int32),
        topk_logprobs=np.array([[-0.5, -1.5]], np.float32),
    )
    (o,) = E.build_request_outputs(s, E.RequestOutputPool())
    assert o.request_id == "a" and o.prompt_token_ids == [2, 3, 4] and not o.finished
    c = o.outputs[0]
    assert c.index == 0 and c.token_ids == [9] and c.cumulative_logprob == pytest.approx(-0.5)
    assert c.logprobs == [{9: pytest.approx(-0.5), 8: pytest.approx(-1.5)}]
    assert c.finish_reason is None and c.stop_reason is None and c.text == ""
    c.text = "hello"
    assert o.outputs[0].text == "hello"
    m = o.metrics
    assert m["arrival_time"] == pytest.approx(t0 - 1.0)
    assert t0 <= m["first_scheduled_time"] <= m["first_token_time"] <= time.time()
    assert m["finished_time"] is None and m["num_cached_tokens"] == 0
    assert o.prompt_logprobs is None


def test_n_samples_outputs_by_index():
    s = make_scheduler()
    s.add_request("a", [2, 3], E.SamplingParams(n=3, max_tokens=2), output_kind="cumulative")
    pool = E.RequestOutputPool()
    step(s, [10, 11, 12])
    (o,) = E.build_request_outputs(s, pool)
    assert [(c.index, c.token_ids) for c in o.outputs] == [(0, [10]), (1, [11]), (2, [12])]
    step(s, [20, 21, 1])  # sample 2 samples EOS
    (o,) = E.build_request_outputs(s, pool)
    assert [(c.index, c.token_ids, c.finish_reason) for c in o.outputs] == [
        (0, [10, 20], "length"),
        (1, [11, 21], "length"),
        (2, [12, 1], "stop"),
    ]
    assert o.finished


def test_abort_produces_final_output():
    s = make_scheduler()
    s.add_request("a", [2, 3], E.SamplingParams(max_tokens=5), output_kind="delta")
    step(s, [10])
    E.build_request_outputs(s, E.RequestOutputPool())
    s.abort_request("a")  # between update and schedule: reported with the next step
    out = s.schedule()
    assert out.num_sample_rows == 0
    s.update(np.zeros(0, np.int32))
    (o,) = E.build_request_outputs(s, E.RequestOutputPool())
    assert o.finished and o.outputs[0].finish_reason == "abort" and o.outputs[0].token_ids == []
    info = E.get_finished_seqs_info(s)
    assert info["request_ids"] == ["a"] and info["statuses"].tolist() == [
        int(E.SequenceStatus.FINISHED_ABORTED)
    ]


def test_pool_recycles_unreferenced_objects_only():
    s = make_scheduler()
    pool = E.RequestOutputPool(max_size=8)
    for k in range(3):
        s.add_request(f"r{k}", [2, 3], E.SamplingParams(max_tokens=10), output_kind="delta")
    step(s, [5, 5, 5])
    first = E.build_request_outputs(s, pool)
    ids = {id(o) for o in first}
    assert len(pool) == 3
    kept = first[0]
    del first
    gc.collect()
    step(s, [6, 6, 6])
    second = E.build_request_outputs(s, pool)
    # Two objects came back from the pool; the one still referenced was not reused.
    assert len({id(o) for o in second} & ids) == 2 and id(kept) not in {id(o) for o in second}
    assert kept.outputs[0].token_ids == [5]  # untouched
    assert len(pool) == 4
    with pytest.raises(ValueError, match="max_size"):
        E.RequestOutputPool(max_size=-1)


def test_get_finished_seqs_info_arrays():
    s = make_scheduler()
    a = s.add_request("a", [2, 3], E.SamplingParams(max_tokens=1))
    b = s.add_request("b", [2, 3, 4], E.SamplingParams(max_tokens=3, stop_token_ids=[8]))
    step(s, [9, 8])
    info = E.get_finished_seqs_info(s)
    assert info["seq_ids"].dtype == np.int64 and info["statuses"].dtype == np.int32
    assert sorted(
        zip(
            info["seq_ids"].tolist(),
            info["request_ids"],
            info["statuses"].tolist(),
            info["num_prompt_tokens"].tolist(),
            info["num_output_tokens"].tolist(),
        )
    ) == [
        (a, "a", int(E.SequenceStatus.FINISHED_LENGTH), 2, 1),
        (b, "b", int(E.SequenceStatus.FINISHED_STOPPED), 3, 1),
    ]
    s.schedule()  # the next step starts a new window; finished requests are released
    assert E.get_finished_seqs_info(s)["seq_ids"].tolist() == []
    with pytest.raises(ValueError, match="no longer exists|not a live"):
        s.get_sequence(a)


def test_placeholder_request_id_is_reserved():
    assert isinstance(E.PLACEHOLDER_REQUEST_ID, str) and E.PLACEHOLDER_REQUEST_ID
    s = make_scheduler()
    with pytest.raises(ValueError, match="reserved"):
        s.add_request(E.PLACEHOLDER_REQUEST_ID, [2])


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
@pytest.mark.parametrize("at_max_tokens", [False, True])
def test_a_stop_string_corrects_the_built_output_instead_of_building_it_twice(kind, at_max_tokens):
    """The detokenizer finds a stop string in an output just built: stop_sequence(output=ro) cuts
    that output in place and the request is not reported again (its outputs are built once)."""
    s = make_scheduler()
    pool = E.RequestOutputPool()
    s.add_request("r", [2, 3], E.SamplingParams(max_tokens=3 if at_max_tokens else 10, logprobs=0, ignore_eos=True), output_kind=kind)
    s.add_request("other", [4, 5], E.SamplingParams(max_tokens=10, ignore_eos=True))
    step(s, [11, 21])
    E.build_request_outputs(s, pool)
    step(s, [12, 22])
    step(s, [13, 23])                       # "r" hits max_tokens here when at_max_tokens
    built = {ro.request_id: ro for ro in E.build_request_outputs(s, pool)}
    ro = built["r"]
    assert ro.finished == at_max_tokens
    seq = s.get_sequences("r")[0].seq_id
    s.stop_sequence(seq, "STOP", 2, output=ro)      # the stop string ends in the 2nd output token
    c = ro.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "STOP" and ro.finished
    assert c.token_ids == ([11, 12] if kind == "cumulative" else [12])   # delta: this build had 12, 13
    assert len(c.logprobs) == len(c.token_ids)
    assert E.build_request_outputs(s, pool) == []    # not built a second time
    info = E.get_finished_seqs_info(s)
    assert info["request_ids"] == ["r"] and info["statuses"].tolist() == [int(E.SequenceStatus.FINISHED_STOPPED)]
    s.add_request("r", [2, 3], E.SamplingParams(max_tokens=1))         # its id is free: its final output was returned
    step(s, [24, 7])
    assert [o.request_id for o in E.build_request_outputs(s, pool)] == ["other", "r"]


def test_stop_sequence_output_of_an_n_gt_1_request_and_bad_outputs():
    s = make_scheduler()
    pool = E.RequestOutputPool()
    s.add_request("r", [2, 3], E.SamplingParams(n=2, max_tokens=10, ignore_eos=True))
    s.add_request("x", [4, 5], E.SamplingParams(max_tokens=10, ignore_eos=True))
    step(s, [11, 12, 21])
    built = {ro.request_id: ro for ro in E.build_request_outputs(s, pool)}
    child = s.get_sequences("r")[1].seq_id
    with pytest.raises(ValueError, match="output: is the output of request 'x'"):
        s.stop_sequence(child, "S", 0, output=built["x"])
    with pytest.raises(TypeError, match="output"):
        s.stop_sequence(child, "S", 0, output="r")
    assert not s.get_sequence(child).is_finished          # refused: nothing changed
    s.stop_sequence(child, "S", 0, output=built["r"])
    by_index = {c.index: c for c in built["r"].outputs}
    assert by_index[1].finish_reason == "stop" and by_index[1].token_ids == []
    assert by_index[0].finish_reason is None and not built["r"].finished
    assert E.build_request_outputs(s, pool) == []
    step(s, [13, 22])
    (r_out,) = [o for o in E.build_request_outputs(s, pool) if o.request_id == "r"]
    assert [c.index for c in r_out.outputs] == [0, 1]      # cumulative: both samples, 1 stays stopped
    assert {c.index: c.finish_reason for c in r_out.outputs} == {0: None, 1: "stop"}


def test_cumulative_logprob_is_none_unless_logprobs_were_requested():
    # vLLM: None without logprobs (not a made-up 0.0); with logprobs=0 the sum of the sampled ones.
    s = make_scheduler()
    s.add_request("plain", [2, 3], E.SamplingParams(max_tokens=2))
    s.add_request("lp", [4, 5], E.SamplingParams(max_tokens=2, logprobs=0))
    pool = E.RequestOutputPool()
    for toks, lps in (([11, 21], [-0.25, -0.5]), ([12, 22], [-1.0, -2.0])):
        step(s, toks, logprobs=np.array(lps, np.float32),
             topk_token_ids=np.zeros((2, 0), np.int32), topk_logprobs=np.zeros((2, 0), np.float32))
        outs = {o.request_id: o.outputs[0] for o in E.build_request_outputs(s, pool)}
        assert outs["plain"].cumulative_logprob is None
    assert outs["lp"].cumulative_logprob == pytest.approx(-0.5 - 2.0)


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_a_one_token_prompts_prompt_logprobs_are_none_for_its_one_position(kind):
    # vLLM gives [None] (position 0 has no logprob); a delta output reports it once.
    s = make_scheduler()
    s.add_request("one", [5], E.SamplingParams(max_tokens=3, prompt_logprobs=1), output_kind=kind)
    pool = E.RequestOutputPool()
    got = []
    for tok in (7, 8):
        step(s, [tok])
        (o,) = E.build_request_outputs(s, pool)
        got.append(o.prompt_logprobs)
    assert got == ([[None], [None]] if kind == "cumulative" else [[None], []])

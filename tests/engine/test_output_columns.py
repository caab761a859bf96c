"""RequestOutputPool's columns (add_columnar / take_columns): the plain deltas of registered
requests as rows instead of RequestOutput objects, everything else as before (issue 25)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_scheduler
from deepinfer_engine import _engine as E


def step(s, tokens):
    out = s.schedule()
    assert out.num_sample_rows == len(tokens)
    s.update(np.asarray(tokens, dtype=np.int32))


def rows(pool):
    slots, offsets, tokens = pool.take_columns()
    assert slots.dtype == np.int32 and offsets.dtype == np.int64 and tokens.dtype == np.int32
    assert len(offsets) == len(slots) + 1 and offsets[0] == 0 and offsets[-1] == len(tokens)
    return [(int(s), tokens[offsets[i] : offsets[i + 1]].tolist()) for i, s in enumerate(slots)]


def objects(s, pool):
    return [
        (o.request_id, [(c.index, c.token_ids, c.finish_reason) for c in o.outputs], o.finished)
        for o in E.build_request_outputs(s, pool)
    ]


def test_a_registered_request_gives_rows_between_its_first_and_last_output_objects():
    s = make_scheduler()
    pool = E.RequestOutputPool()
    s.add_request("col", [4, 5], E.SamplingParams(max_tokens=4), output_kind="delta")
    s.add_request("obj", [4, 5], E.SamplingParams(max_tokens=4), output_kind="delta")
    pool.add_columnar("col", 7)
    assert pool.num_columnar == 1
    step(s, [11, 21])  # the first output: an object for both (its first token)
    assert objects(s, pool) == [
        ("col", [(0, [11], None)], False),
        ("obj", [(0, [21], None)], False),
    ]
    assert rows(pool) == []
    step(s, [12, 22])
    assert objects(s, pool) == [("obj", [(0, [22], None)], False)]
    step(s, [13, 23])
    assert objects(s, pool) == [("obj", [(0, [23], None)], False)]
    assert rows(pool) == [(7, [12]), (7, [13])]  # rows of two builds, in build order
    step(s, [14, 24])  # max_tokens: the finished output is an object, and unregisters it
    assert objects(s, pool) == [
        ("col", [(0, [14], "length")], True),
        ("obj", [(0, [24], "length")], True),
    ]
    assert rows(pool) == [] and pool.num_columnar == 0


def test_what_never_becomes_a_row():
    s = make_scheduler()
    pool = E.RequestOutputPool()
    cases = {
        "n2": (E.SamplingParams(n=2, max_tokens=3), "delta"),
        "lp": (E.SamplingParams(max_tokens=3, logprobs=0), "delta"),
        "plp": (E.SamplingParams(max_tokens=3, prompt_logprobs=0), "delta"),
        "cum": (E.SamplingParams(max_tokens=3), "cumulative"),
    }
    for i, (rid, (params, kind)) in enumerate(cases.items()):
        s.add_request(rid, [4, 5], params, output_kind=kind)
        pool.add_columnar(rid, i)
    seen = set()
    while s.num_unfinished_requests:
        out = s.schedule()
        s.update(
            np.full(out.num_sample_rows, 9, np.int32),
            logprobs=np.zeros(out.num_sample_rows, np.float32),
            topk_token_ids=np.full((out.num_sample_rows, 1), 9, np.int32),
            topk_logprobs=np.zeros((out.num_sample_rows, 1), np.float32),
        )
        seen |= {o.request_id for o in E.build_request_outputs(s, pool)}
        assert rows(pool) == []
    assert (
        seen == set(cases) and pool.num_columnar == 0
    )  # each finished output unregistered its request


def test_an_aborted_request_gets_its_abort_object_and_is_unregistered():
    s = make_scheduler()
    pool = E.RequestOutputPool()
    s.add_request("a", [4, 5], E.SamplingParams(max_tokens=8), output_kind="delta")
    pool.add_columnar("a", 0)
    step(s, [11])
    objects(s, pool)
    step(s, [12])
    assert objects(s, pool) == [] and rows(pool) == [(0, [12])]
    s.abort_request("a")  # between update and schedule: reported with the next step
    out = s.schedule()
    assert out.num_sample_rows == 0
    s.update(np.zeros(0, np.int32))
    assert objects(s, pool) == [("a", [(0, [], "abort")], True)] and rows(pool) == []
    assert pool.num_columnar == 0


def test_columns_registration_and_bad_input():
    pool = E.RequestOutputPool()
    slots, offsets, tokens = pool.take_columns()
    assert slots.shape == (0,) and offsets.tolist() == [0] and tokens.shape == (0,)
    pool.add_columnar("a", 0)
    pool.add_columnar("b", 2**31 - 1)
    with pytest.raises(ValueError, match="registered already"):
        pool.add_columnar("a", 3)
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match="slot"):
            pool.add_columnar("c", bad)
    with pytest.raises(TypeError):
        pool.add_columnar("c", "1")
    with pytest.raises(TypeError):
        pool.add_columnar(None, 1)
    assert pool.num_columnar == 2
    assert pool.discard_columnar("a") is True and pool.discard_columnar("a") is False
    assert pool.num_columnar == 1

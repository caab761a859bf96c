"""The engine core's wire format and the stream's coalescing, without a model: a SamplingParams
crosses as plain data and comes back equal; a step's deltas cross msgpack unchanged (logprobs
keyed by token id included); deltas split anywhere merge back to the whole."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer.serve.client import Message, _split_columns
from deepinfer.serve.core import pid_alive, sampling_params_fields
from deepinfer.serve.engine_run import merge_deltas
from deepinfer.serve.engine_thread import RequestDelta, RequestFailed, SampleDelta


def test_sampling_params_cross_as_plain_data_and_come_back_equal():
    sp = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop=["\n\n", "END"],
                        stop_token_ids=[7, 3], max_tokens=33, min_tokens=2, logprobs=3, prompt_logprobs=1,
                        logit_bias={5: -2.0}, include_stop_str_in_output=True, allowed_token_ids=[1, 2, 3, 5, 7])
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sampling_params_fields(sp)))
    back = SamplingParams(**wire)
    for name in ("n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "max_tokens",
                 "min_tokens", "logprobs", "prompt_logprobs", "logit_bias", "include_stop_str_in_output",
                 "allowed_token_ids", "skip_special_tokens", "ignore_eos"):
        assert getattr(back, name) == getattr(sp, name), name


def test_every_sampling_field_crosses_including_ones_added_later():
    """The whole SamplingParams comes back equal (its ``==`` compares every field), structured
    outputs, extra_args and detokenize included: a field missing from the wire would silently
    serve a request without it (a structured request unconstrained)."""
    from deepinfer.runtime.structured.params import StructuredOutputsParams

    for so in (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
               StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex=r"\d+"),
               StructuredOutputsParams(json_object=True, disable_any_whitespace=True)):
        sp = SamplingParams(n=2, temperature=0.5, stop_token_ids=[4], bad_words=["x"], structured_outputs=so,
                            extra_args={"k": [1, 2]}, detokenize=True, seed=3)
        back = SamplingParams(**msgspec.msgpack.decode(msgspec.msgpack.encode(sampling_params_fields(sp))))
        assert back == sp and back.structured_outputs == so
    sp = SamplingParams(detokenize=False, max_tokens=4)
    assert SamplingParams(**msgspec.msgpack.decode(msgspec.msgpack.encode(sampling_params_fields(sp)))) == sp
    # logprobs -1 (the whole vocabulary) is kept beside the engine's field, which holds 0
    sp = SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=4)
    fields = sampling_params_fields(sp)
    assert fields["logprobs"] == fields["prompt_logprobs"] == -1
    assert SamplingParams(**msgspec.msgpack.decode(msgspec.msgpack.encode(fields))) == sp


def test_a_steps_message_crosses_msgpack_unchanged():
    delta = RequestDelta(1, [SampleDelta(0, [5, 9], "ab", [{5: -0.5, 2: -1.5}, {9: -0.25}], None, None),
                             SampleDelta(1, [4], "c", None, "stop", 13)], True, [None, {3: -2.0}], 4)
    failure = RequestFailed(0, 500, "the request failed: boom")
    columns = (["r-2", "r-3"], np.array([1, 0], "<i4").tobytes(), np.array([77], "<i4").tobytes())
    msg = ("batch", [["metric", "ttft", None, "observe", 0.5]], [("r-1", delta)], [("r-0", failure)], [columns])
    back = msgspec.msgpack.Decoder(Message).decode(msgspec.msgpack.encode(msg))
    assert back[2] == [("r-1", delta)] and back[3] == [("r-0", failure)]
    assert back[1] == [["metric", "ttft", None, "observe", 0.5]]
    assert back[4] == [columns]
    rids, counts, tokens = back[4][0]
    assert _split_columns(rids, counts, tokens) == [[77], []]


def test_columns_split_into_each_rows_tokens_and_malformed_ones_raise():
    def cols(counts, tokens):
        return np.array(counts, "<i4").tobytes(), np.array(tokens, "<i4").tobytes()

    assert _split_columns([], *cols([], [])) == []
    assert _split_columns(["a", "b"], *cols([1, 1], [5, 6])) == [[5], [6]]
    assert _split_columns(["a", "b", "c"], *cols([2, 0, 3], [1, 2, 3, 4, 5])) == [[1, 2], [], [3, 4, 5]]
    for rids, counts, tokens in ((["a"], [1, 1], [5, 6]), (["a", "b"], [1, 2], [5, 6]),
                                 (["a", "b"], [3, -1], [5, 6]), (["a"], [1], [])):
        with pytest.raises(ValueError, match="malformed columns"):
            _split_columns(rids, *cols(counts, tokens))
    with pytest.raises(ValueError, match="malformed columns"):
        _split_columns(["a"], b"\x01\x00\x00\x00", b"\x05\x00")  # not whole int32s


def _deltas(rng: random.Random, tags: int, n: int) -> tuple[list[RequestDelta], dict[int, list[int]]]:
    """Per tag and sample 1..12 tokens in deltas of random sizes; the last delta of a tag finishes."""
    per_tag: list[list[RequestDelta]] = []
    whole = {}
    for tag in range(tags):
        tokens = {i: list(range(rng.randint(1, 12))) for i in range(n)}
        whole[tag] = tokens
        pos = dict.fromkeys(tokens, 0)
        mine: list[RequestDelta] = []
        while any(pos[i] < len(tokens[i]) for i in tokens):
            samples = []
            for i in tokens:
                k = rng.randint(0, len(tokens[i]) - pos[i])
                ids = tokens[i][pos[i]:pos[i] + k]
                pos[i] += k
                done = pos[i] == len(tokens[i])
                samples.append(SampleDelta(i, ids, "".join(f"<{t}>" for t in ids), [{t: -float(t)} for t in ids],
                                           "length" if done else None, None))
            mine.append(RequestDelta(tag, samples, all(pos[i] == len(tokens[i]) for i in tokens), None, 0))
        per_tag.append(mine)
    out: list[RequestDelta] = []
    while any(per_tag):  # the tags interleave at random; each tag's own order holds
        out.append(rng.choice([q for q in per_tag if q]).pop(0))
    return out, whole


@pytest.mark.parametrize("seed", range(20))
def test_deltas_split_anywhere_merge_back_to_the_whole(seed):
    rng = random.Random(seed)
    deltas, whole = _deltas(rng, tags=rng.randint(1, 3), n=rng.randint(1, 3))
    # the stream takes them in batches of any size: merging each batch and then all batches
    # gives the same tokens, text and logprobs as merging everything at once
    cut = sorted(rng.sample(range(1, len(deltas)), k=min(3, len(deltas) - 1))) if len(deltas) > 1 else []
    batches = [deltas[a:b] for a, b in zip([0, *cut], [*cut, len(deltas)], strict=True)]
    merged = merge_deltas([m for b in batches for m in merge_deltas(b)])
    assert sorted(d.tag for d in merged) == sorted(whole)
    for d in merged:
        assert d.finished
        for s in d.samples:
            expect = whole[d.tag][s.index]
            assert s.token_ids == expect
            assert s.text == "".join(f"<{t}>" for t in expect)
            assert s.logprobs == [{t: -float(t)} for t in expect]
            assert s.finish_reason == "length"


def test_pid_alive_tells_a_running_process_from_a_reaped_one():
    import os
    import subprocess
    import sys

    assert pid_alive(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not pid_alive(p.pid)


def test_the_kv_budget_error_says_what_holds_the_gpus_memory(monkeypatch):
    """Two contenders on one GPU (issue 25): the second's error names the memory in use, this
    process's share of it and the other processes NVML lists (torch's CUDA calls stubbed)."""
    import torch
    from deepinfer.runtime.worker import kv_cache

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    monkeypatch.setattr(torch.cuda, "list_gpu_processes", lambda device=None:
                        "GPU:0\nprocess      4242 uses 86000.000 MB GPU memory")
    cfg = type("Cfg", (), {})()
    monkeypatch.setattr(kv_cache, "bytes_per_block", lambda cfg, block_size, dtype: 1 << 20)
    with pytest.raises(ValueError) as err:
        kv_cache.num_blocks_for(cfg, 16, torch.bfloat16, torch.device("cuda"), gpu_memory_utilization=0.5)
    msg = str(err.value)
    assert f"({50 * gib - 90 * gib} bytes)" in msg  # budget: 0.5 x 100 GiB - 90 GiB in use
    assert f"{90 * gib} are in use already" in msg
    assert f"{2 * gib} reserved by this process's torch allocator" in msg
    assert f"{88 * gib} by CUDA contexts and other processes" in msg
    assert "process      4242 uses 86000.000 MB" in msg
    assert "lower its --gpu-memory-utilization" in msg


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n", [500, 20])  # (numpy finds the buckets of 32 values or more)
def test_replayed_histogram_observations_count_as_observe_does(seed, n):
    """A front end replays a step's histogram observations in bulk (``observe_all``); what the
    registry exposes (bucket counts, count, sum) equals ``observe`` called per value (values on
    the bounds, past the last bound, zero and NaN included)."""
    import math

    from deepinfer.serve.metrics import ITL_BUCKETS, observe_all
    from prometheus_client import CollectorRegistry, Histogram

    rng = random.Random(seed)
    values = [rng.choice([rng.random() * 0.3, rng.choice(ITL_BUCKETS), 0.0, 200.0]) for _ in range(n)]

    def exposed(vals, bulk):
        registry = CollectorRegistry()
        h = Histogram("h", "d", ["m"], buckets=ITL_BUCKETS, registry=registry).labels("x")
        if bulk:
            observe_all(h, vals)
        else:
            for v in vals:
                h.observe(v)
        return {(s.name, s.labels.get("le")): s.value for m in registry.collect() for s in m.samples
                if not s.name.endswith("_created")}

    got, want = exposed(values, True), exposed(values, False)
    assert got.pop(("h_sum", None)) == pytest.approx(want.pop(("h_sum", None)), rel=1e-12)
    assert got == want and want[("h_count", None)] == len(values)
    with_nan = exposed(values + [math.nan], True)  # NaN: in the sum, in no bucket (nor the count)
    assert math.isnan(with_nan.pop(("h_sum", None)))
    assert with_nan == want

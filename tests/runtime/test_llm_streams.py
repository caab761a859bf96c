"""Several LLM.stream() iterators (and generate) on one engine: every step's outputs reach the
request they belong to, whoever ran the step; closing a stream early aborts it and frees its
KV blocks. Also: a stop string completed by the max_tokens token finishes with "stop".

Expectations are independent: the greedy output of each prompt run alone through ``generate``
(itself checked against transformers in test_llm.py / test_engine_parity.py), and the engine's
own block counts at the start.
"""

from __future__ import annotations

import random

import pytest
from deepinfer.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], "Once upon a time", "1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def llm(default_gguf):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM

    # float32: these tests compare a request run beside others with the same request alone, and
    # the quantized path is not batch-invariant (mixed steps run torch's bf16-activation int4
    # matmuls, decode-only steps the native kernels; see guide 05)
    return LLM(device="cpu", dtype="float32", max_model_len=128, cpu_kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def alone(llm):
    """(token ids, text) of each prompt of PROMPTS generated on its own."""
    res = []
    for p in PROMPTS:
        (o,) = llm.generate([p], GREEDY, use_tqdm=False)
        res.append((list(o.outputs[0].token_ids), o.outputs[0].text))
    return res


def _free(llm):
    return llm.engine.scheduler.block_manager.num_free_blocks


def _drain(llm):
    while llm.engine.has_unfinished():
        llm.engine.step()


@pytest.mark.parametrize("which,pattern_seed", [((0, 1), None), ((0, 1, 2), None), ((1, 2, 3), 7), ((0, 1, 2, 3), 11)])
def test_interleaved_streams_each_get_their_whole_output(llm, alone, which, pattern_seed):
    start = _free(llm)
    streams = [llm.stream(PROMPTS[i], GREEDY) for i in which]
    toks: list[list[int]] = [[] for _ in which]
    text = ["" for _ in which]
    finished = [False for _ in which]
    rng = random.Random(pattern_seed)
    while not all(finished):
        # round-robin, or a random order (a stream may be read several times in a row)
        order = range(len(which)) if pattern_seed is None else [rng.randrange(len(which))]
        for k in order:
            if finished[k]:
                continue
            ro = next(streams[k])
            assert ro.request_id == streams[k].request_id
            toks[k] += list(ro.outputs[0].token_ids)
            text[k] += ro.outputs[0].text
            finished[k] = ro.finished
    for k, i in enumerate(which):
        assert toks[k] == alone[i][0], (i, toks[k], alone[i][0])
        assert text[k] == alone[i][1]
        with pytest.raises(StopIteration):
            next(streams[k])
    assert not llm.engine.has_unfinished()
    assert _free(llm) == start


def test_generate_while_streams_are_open(llm, alone):
    start = _free(llm)
    a = llm.stream(PROMPTS[0], GREEDY)
    first = next(a)
    got = list(first.outputs[0].token_ids)
    b = llm.stream(PROMPTS[2], GREEDY)  # opened, not read yet: its outputs wait for it
    outs = llm.generate([PROMPTS[1], PROMPTS[3]], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [alone[1][0], alone[3][0]]
    for ro in a:
        got += list(ro.outputs[0].token_ids)
    assert got == alone[0][0]
    assert [t for ro in b for t in ro.outputs[0].token_ids] == alone[2][0]
    assert _free(llm) == start and not llm.engine.has_unfinished()


def test_generate_inside_a_stream_loop(llm, alone):
    got, inner = [], []
    for ro in llm.stream(PROMPTS[3], GREEDY):
        got += list(ro.outputs[0].token_ids)
        if len(inner) < 2:
            inner.append(list(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids))
    assert got == alone[3][0]
    assert inner == [alone[0][0]] * 2


def test_breaking_out_of_a_stream_aborts_it_and_frees_its_blocks(llm):
    start = _free(llm)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    n = 0
    for _ro in llm.stream(list(range(100, 140)), long):  # 40 prompt tokens: several blocks
        assert _free(llm) < start
        n += 1
        if n == 3:
            break  # the iterator is dropped here
    assert _free(llm) == start
    _drain(llm)  # the engine reports the abort once, to nobody
    assert not llm.engine.requests and _free(llm) == start


def test_closing_streams_explicitly_or_by_with_or_unread(llm, alone):
    start = _free(llm)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    a = llm.stream(list(range(200, 240)), long)
    next(a)
    with llm.stream(list(range(300, 340)), long) as b:
        next(b)
        keep = llm.stream(PROMPTS[1], GREEDY)  # runs on while the others are closed
        next(keep)
    a.close()
    a.close()  # idempotent
    with pytest.raises(StopIteration):
        next(a)
    unread = llm.stream(list(range(400, 440)), long)
    llm.engine.step()  # prefilled: holds blocks
    del unread
    rest = [t for ro in keep for t in ro.outputs[0].token_ids]
    assert rest == alone[1][0][1:]
    _drain(llm)
    assert not llm.engine.requests and _free(llm) == start


def test_stream_checks_its_prompt_when_called(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.stream([], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.stream([1, 10**7], GREEDY)
    with pytest.raises(ValueError, match="one prompt"):
        llm.stream(["a", "b"], GREEDY)
    assert not llm.engine.requests


def test_output_queues_reject_unknown_requests(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="no output queue"):
        eng.next_output("nobody")
    with pytest.raises(ValueError, match="collect must be"):
        eng.add_request(eng.new_request_id(), [1, 2], GREEDY, collect="some")
    rid = eng.new_request_id()
    eng.add_request(rid, [1, 2], GREEDY, collect="all")
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request(rid, [3, 4], GREEDY)
    eng.release(rid)
    _drain(llm)
    assert not eng.requests


def test_take_outputs_takes_only_the_asked_ids_and_leaves_the_others_queued(llm, alone):
    """The server's engine thread takes a step's outputs with ``take_outputs(its live ids)``; a
    request of another owner (here one read with ``pop_output``) keeps its queue, and each
    owner gets every output of its requests, equal to the request run alone."""
    eng = llm.engine
    start = _free(llm)
    mine = [eng.new_request_id() for _ in range(2)]
    theirs = eng.new_request_id()
    for rid, i in zip(mine, (0, 1), strict=True):
        eng.add_request(rid, PROMPTS[i], GREEDY, collect="all")
    eng.add_request(theirs, PROMPTS[0], GREEDY, collect="all")  # (token ids: add_request takes no text)
    live = set(mine)
    toks: dict[str, list[int]] = {rid: [] for rid in mine}
    held = []
    for _ in range(64):
        if not live:
            break
        eng.step()
        for rid, taken in eng.take_outputs(live):
            assert rid in live and not isinstance(taken, BaseException)
            for ro in taken:  # (cumulative outputs: each holds every token so far)
                assert len(ro.outputs[0].token_ids) > len(toks[rid])
                toks[rid] = list(ro.outputs[0].token_ids)
                if ro.finished:
                    live.discard(rid)
    assert not live
    assert [toks[rid] for rid in mine] == [alone[0][0], alone[1][0]]
    _drain(llm)
    # nothing of the other owner's request was taken: every output of it waited in its queue
    while True:
        ro = eng.pop_output(theirs)
        assert ro is not None
        held.append(ro)
        if ro.finished:
            break
    assert len(held) == len(alone[0][0]) and list(held[-1].outputs[0].token_ids) == alone[0][0]
    assert eng.take_outputs(set(mine) | {theirs}) == []  # all taken: no queue left
    assert _free(llm) == start
    # generate never calls take_outputs: its finished requests leave nothing behind either
    llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False)
    assert not eng._queues and not eng._queued


# ---- finish reason of a stop string completed by the last allowed token --------------------
# Greedy "1, 2, 3, 4, 5," continues " 6, 7, 8, ..." one character per token (' ', '6', ',', ...),
# hand-checked with the tokenizer; test_stop_strings_land_on_the_max_tokens_token re-derives the
# text each time rather than trusting this comment.

def test_stop_string_on_the_max_tokens_token_finishes_with_stop(llm):
    count = "1, 2, 3, 4, 5,"
    for k in (5, 6, 8):
        (plain,) = llm.generate(count, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True), use_tqdm=False)
        text = plain.outputs[0].text
        stop = text[-2:]  # completed by token k (its last character), found nowhere earlier
        assert text.find(stop) == len(text) - 2 and plain.outputs[0].finish_reason == "length"
        params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, stop=[stop])
        (cut,) = llm.generate(count, params, use_tqdm=False)
        c = cut.outputs[0]
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:-2])
        assert list(c.token_ids) == list(plain.outputs[0].token_ids)
        deltas = list(llm.stream(count, params))
        last = deltas[-1].outputs[0]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
        assert "".join(d.outputs[0].text for d in deltas) == text[:-2]
        # one token short of the stop string: it never ends the text, the finish stays "length"
        (short,) = llm.generate(count, SamplingParams(temperature=0.0, max_tokens=k - 1, ignore_eos=True, stop=[stop]),
                                use_tqdm=False)
        assert short.outputs[0].finish_reason == "length" and short.outputs[0].stop_reason is None

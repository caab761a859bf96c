"""``LLM`` under careless or hostile use: one bad request never hurts another, bad arguments get
a TypeError/ValueError naming them, and the documented sampling semantics hold.

Expectations are independent: each prompt's greedy output generated alone (itself checked
against transformers in test_llm.py), one-go decodes of the token ids, and hand-picked cases.
"""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer.runtime.engine import loop as engine_loop
from deepinfer.runtime.engine.detokenizer import decode_completion
from deepinfer.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(default_gguf):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM

    return LLM(device="cpu", max_model_len=128, cpu_kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def alone(llm):
    (o,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return list(o.outputs[0].token_ids), o.outputs[0].text


def _free(llm):
    return llm.engine.scheduler.block_manager.num_free_blocks


def _stream_all(llm, prompt, sp):
    ids, text, last = [], "", None
    for ro in llm.stream(prompt, sp):
        for c in ro.outputs:
            ids += list(c.token_ids)
            text += c.text
        last = ro
    return ids, text, last


def test_an_error_building_one_requests_output_fails_that_request_only(llm, alone, monkeypatch):
    # A failure while one request's output is built (here its final decode) must not cost an
    # open stream the token of that step: the stream keeps every token, the bad request fails.
    start = _free(llm)
    bad_prompt = "Tell me a story"
    bad_ids = list(llm.tokenizer(bad_prompt).input_ids)
    real = engine_loop.decode_completion

    def failing(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
        if list(prompt_ids) == bad_ids:
            raise TypeError("decode failed for this request")
        return real(tokenizer, prompt_ids, output_ids, skip_special_tokens)

    monkeypatch.setattr(engine_loop, "decode_completion", failing)
    stream = llm.stream(PROMPT, GREEDY)
    got = list(next(stream).outputs[0].token_ids)
    with pytest.raises(TypeError, match="decode failed"):
        llm.generate(bad_prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    for ro in stream:
        got += list(ro.outputs[0].token_ids)
    assert got == alone[0]
    monkeypatch.undo()
    assert not llm.engine.requests and _free(llm) == start
    assert llm.engine.scheduler.check_invariants() == ""
    (again,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert list(again.outputs[0].token_ids) == alone[0]


@pytest.mark.parametrize("prompt", [b"The capital of France is", bytearray(b"The capital"), [b"abc", "def"]])
def test_bytes_prompts_are_refused_not_taken_as_token_ids(llm, prompt):
    with pytest.raises(TypeError, match="bytes|bytearray"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="bytes|bytearray"):
        llm.stream(prompt if not isinstance(prompt, list) else prompt[0], GREEDY)
    assert not llm.engine.requests


def test_unclear_inputs_get_errors_naming_them(llm):
    with pytest.raises(ValueError, match=r"prompts\[0\] is not valid Unicode"):
        llm.generate("abc \ud800 def", GREEDY, use_tqdm=False)
    for content in (None, 5):
        with pytest.raises(TypeError, match=r"messages\[0\]\['content'\]"):
            llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)  # type: ignore[arg-type]
    assert not llm.engine.requests


def test_numpy_scalars_and_numpy_token_ids_work_end_to_end(llm, alone):
    sp = SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(12), ignore_eos=True)
    ids = np.array(llm.tokenizer(PROMPT).input_ids, dtype=np.int64)
    (o,) = llm.generate([list(ids)], sp, use_tqdm=False)
    assert list(o.outputs[0].token_ids) == alone[0]


@pytest.mark.parametrize("temperature", [1e-37, 5e-38, 1e-40])
def test_tiny_temperature_generates_the_greedy_text(llm, alone, temperature):
    sp = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=3)
    (o,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert list(o.outputs[0].token_ids) == alone[0] and o.outputs[0].text == alone[1]


def test_text_is_the_same_from_generate_and_stream_when_a_reply_ends_inside_a_character(llm):
    # A logit bias forces the first byte of "這" (a 3-byte character): the completion ends with
    # an incomplete character. generate (one-go decode), generate with a stop string
    # (incremental path) and the joined stream deltas give the same text.
    lead = llm.tokenizer.encode("這", add_special_tokens=False)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={lead: 100.0})
    (plain,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert list(plain.outputs[0].token_ids) == [lead]
    want = decode_completion(llm.tokenizer, llm.tokenizer(PROMPT).input_ids, [lead])
    assert plain.outputs[0].text == want and want.endswith("\ufffd")
    (stopped,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={lead: 100.0},
                                                       stop=["zzz"]), use_tqdm=False)
    assert stopped.outputs[0].text == want
    assert _stream_all(llm, PROMPT, sp)[1] == want


def test_a_stop_string_does_not_end_the_completion_before_min_tokens(llm, alone):
    ids, text = alone
    first = llm.tokenizer.decode(ids[:1]).strip()
    assert first and text.strip().startswith(first)
    (early,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                     stop=[first]), use_tqdm=False)
    assert len(early.outputs[0].token_ids) <= 1  # without min_tokens it stops at once
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[first], min_tokens=6)
    (o,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert len(o.outputs[0].token_ids) >= 6
    assert list(o.outputs[0].token_ids) == ids[:len(o.outputs[0].token_ids)]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_excluded_unless_asked(llm, alone, include):
    ids, _ = alone
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i] and llm.tokenizer.decode([ids[i]]).strip())
    sp = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ids[k]], include_stop_str_in_output=include)
    prompt_ids = llm.tokenizer(PROMPT).input_ids
    want = decode_completion(llm.tokenizer, prompt_ids, ids[:k + 1] if include else ids[:k])
    (o,) = llm.generate([PROMPT], sp, use_tqdm=False)
    c = o.outputs[0]
    assert list(c.token_ids) == ids[:k + 1] and c.finish_reason == "stop" and c.stop_reason == ids[k]
    assert c.text == want
    streamed_ids, streamed_text, _ = _stream_all(llm, PROMPT, sp)
    assert streamed_ids == ids[:k + 1] and streamed_text == want
    (with_stop_string,) = llm.generate([PROMPT], SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[ids[k]], include_stop_str_in_output=include,
        stop=["zzz"]), use_tqdm=False)
    assert with_stop_string.outputs[0].text == want


@pytest.mark.parametrize(("kwargs", "exc", "needle"), [
    ({"seed": -1}, ValueError, "seed"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"max_model_len": True}, TypeError, "max_model_len"),
    ({"max_model_len": 10**9}, ValueError, "max_model_len"),
    ({"num_kv_blocks": 2**40}, ValueError, "num_kv_blocks"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"max_num_seqs": "8"}, TypeError, "max_num_seqs"),
    ({"enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching"),
    ({"cpu_kv_cache_bytes": -1}, ValueError, "cpu_kv_cache_bytes"),
    ({"num_threads": 0}, ValueError, "num_threads"),
])
def test_bad_llm_arguments_are_named(default_gguf, kwargs, exc, needle):
    from deepinfer import LLM

    with pytest.raises(exc, match=needle):
        LLM(device="cpu", **kwargs)


def test_a_model_path_that_is_not_a_file_or_directory_is_named():
    from deepinfer import LLM

    with pytest.raises(ValueError, match="/dev/null.*neither a regular file"):
        LLM("/dev/null", device="cpu")


def test_abort_from_another_thread_ends_a_stream_with_abort_and_frees_its_blocks(llm, alone):
    import threading

    start = _free(llm)
    s = llm.stream(PROMPT, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    got = list(next(s).outputs[0].token_ids)
    t = threading.Thread(target=llm.abort, args=(s.request_id,))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    assert _free(llm) == start  # freed by the abort, before the stream reads on
    rest = list(s)
    assert rest and rest[-1].finished
    assert [c.finish_reason for c in rest[-1].outputs] in ([], ["abort"])
    got += [t for ro in rest for c in ro.outputs for t in c.token_ids]
    assert got == alone[0][:len(got)]
    llm.abort(s.request_id)  # finished: ignored
    llm.abort("no-such-request")
    with pytest.raises(TypeError, match="request_id"):
        llm.abort(5)  # type: ignore[arg-type]
    assert not llm.engine.requests and _free(llm) == start

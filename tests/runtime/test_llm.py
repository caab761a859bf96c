"""The user-facing LLM on the default model: generate, chat, streaming, stop strings, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(default_gguf):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM

    # float32: the dense path, whose greedy tokens equal transformers' (the default keeps the
    # GGUF quantization: tests/runtime/test_quantized_parity.py)
    return LLM(device="cpu", dtype="float32", max_model_len=256, cpu_kv_cache_bytes=64 << 20)


def test_generate_returns_text_in_prompt_order(llm, tokenizer, hf_greedy):
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tokenizer(p).input_ids for p in prompts]
    for p, o in zip(prompts, outs, strict=True):
        c = o.outputs[0]
        assert list(c.token_ids) == hf_greedy(tokenizer(p).input_ids, 6)
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert o.finished and c.finish_reason == "length"


def test_chat_uses_the_chat_template_and_stops_at_eos(llm, tokenizer):
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    (out,) = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    expected = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert list(out.prompt_token_ids) == tokenizer(expected, add_special_tokens=False).input_ids
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # EOS (<|im_end|>) before max_tokens


def test_stop_string_ends_text_at_its_first_character(llm):
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate("1, 2, 3, 4, 5,", base, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[text.index("8"):text.index("8") + 2]  # spans the generated "8," (a token boundary or not)
    (cut,) = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)
    c = cut.outputs[0]
    assert c.text == text[:text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < len(full.outputs[0].token_ids)
    (kept,) = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                          stop=[stop], include_stop_str_in_output=True),
                           use_tqdm=False)
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]


def test_stream_deltas_add_up_to_the_generated_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (full,) = llm.generate("Once upon a time", params, use_tqdm=False)
    pieces, tokens, last = [], [], None
    for delta in llm.stream("Once upon a time", params):
        pieces.append(delta.outputs[0].text)
        tokens.extend(delta.outputs[0].token_ids)
        last = delta
    assert last is not None and last.finished
    assert "".join(pieces) == full.outputs[0].text
    assert tokens == list(full.outputs[0].token_ids)
    assert len(pieces) > 3


def test_bad_input_is_rejected_clearly(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llm.generate(["ok", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**7]], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["a"], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # the LLM still works after the rejected calls
    (ok,) = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) >= 1


def test_prompt_token_ids_are_checked_whatever_their_int_type(llm):
    """Lists of Python ints take a fast check; numpy ints take the general one; bools are no ids."""
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        llm.generate([[5, -1, 7]], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([[5, True, 7]], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (a,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    (b,) = llm.generate([[np.int64(5), np.int32(6), 7]], params, use_tqdm=False)
    assert list(b.prompt_token_ids) == [5, 6, 7]
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)


def test_prompts_of_the_wrong_type_name_what_is_wrong(llm):
    """Each wrong prompt is a TypeError naming where it is and what was found (never "'NoneType'
    object is not iterable"); arrays of ids and iterators are prompts like their lists."""
    cases = [
        (None, r"^prompts must be a string, a list of token ids, a dict, or a list of these, got NoneType$"),
        (7, "got int$"),
        ([[1, "a", 3]], r"^prompts\[0\]: a list prompt holds token ids \(ints\), but item 1 is str 'a'$"),
        ([{"prompt_token_ids": [1.5, 2]}], r"^prompts\[0\]\['prompt_token_ids'\]: .* item 0 is float 1.5$"),
        ([{"prompt_token_ids": 7}], r"^prompts\[0\]\['prompt_token_ids'\] must be a list of token ids, got int$"),
        (["ok", None], r"^prompts\[1\]: a prompt must be a string, a list of token ids or a dict, got NoneType$"),
    ]
    for prompts, message in cases:
        with pytest.raises(TypeError, match=message):
            llm.generate(prompts, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    as_lists = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in as_lists]
    (one,) = llm.generate(np.array([5, 6, 7]), params, use_tqdm=False)
    assert list(one.prompt_token_ids) == [5, 6, 7] and list(one.outputs[0].token_ids) == expected[0]
    for ids in (np.array([5, 6, 7]), (5, 6, 7)):  # any iterable of ids under 'prompt_token_ids', as before
        (d,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        assert list(d.prompt_token_ids) == [5, 6, 7] and list(d.outputs[0].token_ids) == expected[0]
    rows = llm.generate(np.array([[5, 6, 7], [8, 9, 10]])[:, :3], params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in rows] == [[5, 6, 7], [8, 9, 10]]
    # an iterator is read once: its prompts' texts come back with their outputs
    texts = ["Hi", "Hello"]
    outs = llm.generate(iter(texts), params, use_tqdm=False)
    assert [o.prompt for o in outs] == texts
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(o.outputs[0].token_ids) for o in llm.generate(texts, params, use_tqdm=False)]


def test_too_long_prompt_is_refused_with_both_counts_and_nothing_runs(llm):
    long_prompt = [100 + (i % 500) for i in range(300)]  # > max_model_len (256)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    steps = llm.engine.num_steps
    with pytest.raises(ValueError, match=r"prompts\[1\] has 300 tokens, more than max_model_len=256"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": long_prompt}, "Hello"], sp,
                     use_tqdm=False)
    with pytest.raises(ValueError, match="300 tokens.*256"):
        llm.stream(long_prompt, sp)
    assert llm.engine.num_steps == steps and not llm.engine.requests
    # max_model_len counts prompt + completion: the longest prompt that fits leaves one token
    with pytest.raises(ValueError, match=r"256 tokens, as many as max_model_len=256"):
        llm.generate([long_prompt[:256]], sp, use_tqdm=False)
    (out,) = llm.generate([long_prompt[:255]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert out.finished and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1


def test_a_rejected_request_leaves_running_ones_untouched(llm):
    engine = llm.engine
    good = engine.new_request_id()
    engine.add_request(good, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", [], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("bad2", [1, 2], SamplingParams(stop_token_ids=[10**6]))
    done = None
    while done is None:
        for ro in engine.step():
            if ro.request_id == good and ro.finished:
                done = ro
    assert len(done.outputs[0].token_ids) == 3

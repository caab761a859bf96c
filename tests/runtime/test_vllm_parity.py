"""vLLM's offline API on ``LLM`` (issue 26): ``RequestOutput.prompt``, ``dtype="auto"``,
``trust_remote_code``, ``max_logprobs``, ``get_tokenizer()``, ``chat_template_kwargs``, and
what ``repr(LLM)`` says the default model runs as."""

from __future__ import annotations

import pytest
from deepinfer.runtime.engine_args import EngineArgs
from deepinfer.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(default_gguf):
    from deepinfer.runtime.llm import LLM

    return LLM(default_gguf, max_model_len=256, cpu_kv_cache_bytes=16 << 20, dtype="auto",
               trust_remote_code=True, max_logprobs=4)


def test_vllm_quickstart_loop_prints_prompt_and_text(llm):
    prompts = ["Hello, my name is", {"prompt": "The capital of France is"}, [1, 2, 3]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    lines = [f"{output.prompt!r} {output.outputs[0].text!r}" for output in outputs]  # vLLM's quickstart
    assert [o.prompt for o in outputs] == ["Hello, my name is", "The capital of France is", None]
    assert all(len(o.outputs[0].token_ids) == 3 and o.finished for o in outputs) and len(lines) == 3
    assert outputs[0].prompt_token_ids == list(llm.text_tokenizer("Hello, my name is").input_ids)
    assert "prompt='Hello, my name is'" in repr(outputs[0])
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert chat.prompt is None  # a chat prompt goes in as token ids


def test_dtype_auto_is_the_default_choice():
    assert EngineArgs(dtype="auto").dtype is None
    assert EngineArgs(dtype="auto") == EngineArgs()
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(dtype="float64")


def test_trust_remote_code_is_accepted_and_runs_nothing(llm):
    assert llm.engine_args.trust_remote_code is True
    with pytest.raises(TypeError, match="trust_remote_code"):
        EngineArgs(trust_remote_code="yes")


def test_max_logprobs_caps_requests(llm):
    llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=4, prompt_logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs=4"):
        llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs=5 is more than max_logprobs"):
        llm.generate("Hi", SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    assert EngineArgs().max_logprobs == 20  # vLLM's default
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2)  # (-1: no cap, as vLLM's)


def test_get_tokenizer_is_the_transformers_tokenizer(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    assert tok("Hello").input_ids == list(llm.text_tokenizer("Hello").input_ids)


def test_chat_template_kwargs_reach_the_template(llm):
    conv = [{"role": "user", "content": "Hi"}]
    tok = llm.text_tokenizer
    template = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ marker | default('') }}"
        plain = llm.apply_chat_template(conv)["prompt_token_ids"]
        marked = llm.apply_chat_template(conv, chat_template_kwargs={"marker": " MARK"})["prompt_token_ids"]
        assert tok.decode(plain) == "Hi" and tok.decode(marked) == "Hi MARK"
        out = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"marker": " MARK"})
        assert list(out[0].prompt_token_ids) == marked
        with pytest.raises(ValueError, match="add_generation_prompt"):
            llm.apply_chat_template(conv, chat_template_kwargs={"add_generation_prompt": False})
    finally:
        tok.chat_template = template


def test_repr_says_weights_q4_1_activations_float32(llm):
    assert llm.weight_format == "Q4_1"
    assert llm.precision() == "weights Q4_1, activations float32"
    assert "weights='Q4_1', activations='float32'" in repr(llm) and "dtype=" not in repr(llm)


def test_generate_progress_bar_has_no_eta(llm, capsys):
    import re

    llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=2), use_tqdm=True)
    err = capsys.readouterr().err
    assert "Generating" in err and "2/2" in err
    assert re.search(r"<\d+:\d\d", err) is None  # tqdm's "elapsed<remaining"


def test_cache_salt_in_a_dict_prompt_isolates_the_prefix_cache(llm):
    # vLLM's prompt field: a prompt reuses prefix-cached KV only of prompts with the same salt
    sp = SamplingParams(temperature=0, max_tokens=2)
    text = "Cache salt check: " + "the weather was fine, " * 10  # (several blocks; no other test sends it)

    def cached(**fields) -> tuple[int, str]:
        out = llm.generate({"prompt": text, **fields}, sp, use_tqdm=False)[0]
        return out.metrics["num_cached_tokens"], out.outputs[0].text

    assert cached()[0] == 0
    hit, reply = cached()
    assert hit > 0
    assert cached(cache_salt="tenant-a") == (0, reply)
    assert cached(cache_salt="tenant-a") == (hit, reply)
    assert cached(cache_salt="tenant-b") == (0, reply)
    assert cached(cache_salt=None) == (hit, reply)  # None: no salt, the shared cache
    ids = llm.text_tokenizer(text).input_ids
    with llm.stream({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, sp) as stream:
        outs = list(stream)
    assert "".join(o.outputs[0].text for o in outs) == reply
    assert outs[-1].metrics["num_cached_tokens"] == hit


@pytest.mark.parametrize(("prompt", "error", "words"), [
    ({"prompt": "Hi", "cache_salt": ""}, ValueError, r"prompts\[0\]\['cache_salt'\] must be a non-empty string"),
    ({"prompt": "Hi", "cache_salt": 7}, ValueError, "must be a non-empty string, got 7"),
    ({"prompt": "Hi", "multi_modal_data": {"image": None}}, ValueError, "unknown prompt field 'multi_modal_data'"),
    ({"promt": "Hi"}, ValueError, "unknown prompt field 'promt'"),
])
def test_a_dict_prompt_field_that_cannot_be_honoured_is_refused(llm, prompt, error, words):
    # before, unknown fields were dropped silently (an image prompt ran as text alone)
    with pytest.raises(error, match=words):
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)


def test_beam_search_refuses_a_cache_salt(llm):
    from deepinfer.runtime.beam_search import BeamSearchParams

    with pytest.raises(ValueError, match="cache_salt is taken by generate"):
        llm.beam_search([{"prompt": "Hi", "cache_salt": "a"}], BeamSearchParams(beam_width=2, max_tokens=2))


def test_chat_template_replaces_the_models(llm):
    # vLLM's LLM.chat(chat_template=...): for a model without a template, or to override it
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    msgs = [{"role": "user", "content": "Hi"}]
    ids = llm.apply_chat_template(msgs, chat_template=template)["prompt_token_ids"]
    assert ids == list(llm.text_tokenizer("[user] Hi\n[assistant] ", add_special_tokens=False).input_ids)
    sp = SamplingParams(temperature=0, max_tokens=3)
    chat = llm.chat(msgs, sp, use_tqdm=False, chat_template=template)[0]
    alone = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1\)"):
        llm.apply_chat_template(msgs, chat_template="{% for m in messages %}")
    with pytest.raises(TypeError, match="chat_template must be a non-empty str"):
        llm.apply_chat_template(msgs, chat_template="")
    own = llm.text_tokenizer.chat_template
    try:  # a model without a template: the error says how to give one
        llm.text_tokenizer.chat_template = None
        with pytest.raises(ValueError, match="has no chat template: give one"):
            llm.apply_chat_template(msgs)
        assert llm.apply_chat_template(msgs, chat_template=template)["prompt_token_ids"] == ids
    finally:
        llm.text_tokenizer.chat_template = own


def test_chat_continue_final_message_and_tools_reach_the_template(llm):
    # vLLM's LLM.chat(continue_final_message=, tools=): checked against the tokenizer's own rendering
    partial = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    sp = SamplingParams(temperature=0, max_tokens=3)
    ids = llm.text_tokenizer.apply_chat_template(partial, tokenize=True, continue_final_message=True)
    assert llm.text_tokenizer.decode(ids).endswith("My favourite is")
    chat = llm.chat(partial, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    alone = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(partial, sp, use_tqdm=False, continue_final_message=True)  # (add_generation_prompt defaults on)
    template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with_tools = llm.chat([{"role": "user", "content": "Hi"}], sp, use_tqdm=False, chat_template=template,
                          tools=[tool])[0]
    assert with_tools.prompt_token_ids == list(llm.text_tokenizer("get_weather;Hi", add_special_tokens=False).input_ids)
    with pytest.raises(ValueError, match="tools is given twice"):
        llm.chat([{"role": "user", "content": "Hi"}], sp, use_tqdm=False, tools=[tool],
                 chat_template_kwargs={"tools": [tool]})

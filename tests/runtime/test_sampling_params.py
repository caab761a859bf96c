"""SamplingParams validation: each bad value raises an error naming the argument and the value."""

from __future__ import annotations

import pytest
from deepinfer.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.2}, "min_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 100}, "prompt_logprobs"),
    ({"logit_bias": {3: 500.0}}, "logit_bias"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias"),
    ({"seed": "x"}, "seed"),
    ({"n": True}, "n"),
])
def test_invalid_values_are_named(kwargs, needle):
    with pytest.raises((ValueError, TypeError)) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value)


def test_normalisation_and_vocab_checks():
    p = SamplingParams(stop="###", top_k=0, logit_bias={5: 1})
    assert p.stop_strings == ["###"] and p.top_k == -1 and p.logit_bias == {5: 1.0}
    p.check_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[12]).check_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).check_vocab(10)
    assert SamplingParams(temperature=0).is_greedy

"""SamplingParams validation: each bad value raises an error naming the argument and the value."""

from __future__ import annotations

from typing import ClassVar

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
    ({"logprobs": -2}, "logprobs"),  # (-1 is the whole vocabulary, as vLLM)
    ({"prompt_logprobs": 100}, "prompt_logprobs"),
    ({"logit_bias": {3: 500.0}}, "logit_bias"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias"),
    ({"seed": "x"}, "seed"),
    ({"n": True}, "n"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": 5}, "include_stop_str_in_output"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"temperature": "0.5"}, "temperature"),
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


def test_every_assignment_is_validated_and_a_refused_one_changes_nothing():
    p = SamplingParams(max_tokens=10, min_tokens=2)
    for name, bad in [("logprobs", 1000), ("skip_special_tokens", "no"), ("include_stop_str_in_output", 5),
                      ("skip_special_tokens", [1]), ("max_tokens", 0), ("max_tokens", 1), ("temperature", -1.0),
                      ("stop", [""]), ("stop_token_ids", 5), ("logit_bias", {1: 1e9}), ("top_k", -5)]:
        before = repr(p)
        with pytest.raises((TypeError, ValueError), match=name.split("_")[0]):
            setattr(p, name, bad)
        assert repr(p) == before, name
    with pytest.raises(AttributeError, match="no field 'temprature'"):
        p.temprature = 0.5  # a typo is not silently a new attribute


def test_derived_fields_follow_assignment():
    p = SamplingParams()
    assert p.stop_strings == []
    p.stop = "Paris"
    assert p.stop_strings == ["Paris"]
    p.stop = ["a", "b"]
    assert p.stop_strings == ["a", "b"]
    p.top_k = 0
    assert p.top_k == -1
    p.temperature = 0.0
    assert p.is_greedy and p.effective_temperature == 0.0
    with pytest.raises(AttributeError):  # stored as tuples: no in-place change past validation
        p.stop_token_ids.append(-1)  # type: ignore[union-attr]


def test_a_logit_bias_cannot_be_changed_in_place_past_validation():
    p = SamplingParams(logit_bias={1: 1.0})
    with pytest.raises(TypeError, match="logit_bias is read-only"):
        p.logit_bias[2] = 1e6  # type: ignore[index]
    with pytest.raises(TypeError, match="logit_bias is read-only"):
        p.logit_bias.update({2: 1e6})  # type: ignore[union-attr]
    assert p.logit_bias == {1: 1.0}
    p.validate()
    p.logit_bias = {**p.logit_bias, 2: 5.0}  # a new dict is validated like any assignment
    assert p.logit_bias == {1: 1.0, 2: 5.0} and p.engine.logit_bias == {1: 1.0, 2: 5.0}
    with pytest.raises(ValueError, match=r"SamplingParams.logit_bias: bias 1e\+06 of token 2"):
        p.logit_bias = {**p.logit_bias, 2: 1e6}
    assert p.logit_bias == {1: 1.0, 2: 5.0}


def test_numpy_scalars_are_accepted_where_python_numbers_are():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5), n=np.int32(2),
                       max_tokens=np.int64(7), seed=np.uint32(3), stop_token_ids=np.array([4, 5]),
                       logit_bias={np.int64(3): np.float32(1.5)}, ignore_eos=np.bool_(True))
    assert (p.temperature, p.top_p, p.top_k, p.n, p.max_tokens, p.seed) == (0.5, 0.9, 5, 2, 7, 3)
    assert p.stop_token_ids == (4, 5) and p.logit_bias == {3: 1.5} and p.ignore_eos is True
    assert all(type(v) in (int, float, bool) for v in (p.temperature, p.top_k, p.seed, p.ignore_eos))


def test_tiny_temperatures_are_greedy_below_the_documented_threshold():
    from deepinfer.runtime.sampling_params import GREEDY_TEMPERATURE_THRESHOLD

    for t in (1e-37, 5e-38, 1e-40, 0.0, GREEDY_TEMPERATURE_THRESHOLD / 2):
        assert SamplingParams(temperature=t).effective_temperature == 0.0
    assert SamplingParams(temperature=GREEDY_TEMPERATURE_THRESHOLD).effective_temperature == GREEDY_TEMPERATURE_THRESHOLD


def test_replace_revalidates():
    import dataclasses

    p = SamplingParams(max_tokens=4)
    assert dataclasses.replace(p, max_tokens=8).max_tokens == 8
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(p, max_tokens=-1)


def test_engine_fields_live_in_the_engine_object_only():
    p = SamplingParams(temperature=0.5, max_tokens=7, stop_token_ids=[9, 3, 9], allowed_token_ids=[4, 2],
                       stop="x", bad_words=["foo"])
    eng = p.engine
    assert type(eng).__module__.startswith("deepinfer_engine") and type(eng).__name__ == "SamplingParams"
    assert (eng.temperature, eng.max_tokens, eng.stop_token_ids, eng.allowed_token_ids) == (0.5, 7, [3, 9], [2, 4])
    assert p.stop_token_ids == (3, 9) and p.allowed_token_ids == (2, 4)
    p.max_tokens = 9  # an assignment lands in the engine object
    assert eng.max_tokens == 9
    eng.min_tokens = 4  # and the engine object is the field's only storage
    assert p.min_tokens == 4
    # no engine value is kept on the Python side
    assert not any(k.lstrip("_") in eng.FIELDS for k in vars(p))


def test_allowed_token_ids_and_bad_words_fields():
    p = SamplingParams(allowed_token_ids=[5, 1, 5], bad_words="hello")
    assert p.allowed_token_ids == (1, 5) and p.bad_words == ("hello",)
    assert SamplingParams().allowed_token_ids is None and SamplingParams().bad_words == ()
    for kw, exc, needle in [({"allowed_token_ids": []}, ValueError, "SamplingParams.allowed_token_ids: must not be empty"),
                            ({"allowed_token_ids": [-1]}, ValueError, "SamplingParams.allowed_token_ids"),
                            ({"allowed_token_ids": "ab"}, TypeError, "SamplingParams.allowed_token_ids"),
                            ({"bad_words": [""]}, ValueError, "SamplingParams.bad_words"),
                            ({"bad_words": [3]}, TypeError, "SamplingParams.bad_words")]:
        with pytest.raises(exc, match=needle):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="allowed_token_ids: token id 7 is outside the vocabulary"):
        SamplingParams(allowed_token_ids=[7]).check_vocab(7)


class _Tok:
    """A word-level tokenizer: "a b" -> ids of "a", " b" (a leading space is a different token)."""

    vocab: ClassVar[dict[str, int]] = {" ": 1, "foo": 10, " foo": 11, "bar": 12, " bar": 13, "baz": 14}  # no " baz": " " + "baz"

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        ids, word = [], ""
        for ch in [*text, " "]:
            if ch == " " and word.strip():
                ids += [self.vocab[word]] if word in self.vocab else [self.vocab[" "], self.vocab[word[1:]]]
                word = ""
            word += ch
        return ids


def test_engine_params_merges_what_the_loop_decides():
    p = SamplingParams(temperature=1e-7, stop_token_ids=[4], bad_words=["foo bar", " baz"])
    e = p.engine_params(_Tok(), extra_stop_token_ids=[2, 4])
    assert e is not p.engine and e.stop_token_ids == [2, 4] and e.temperature == 0.0
    # "foo bar" at the start of a text [10, 13] and after a space [11, 13]; " baz" is two tokens
    # [1, 14], not as many as "baz": vLLM keeps the one form then
    assert e.bad_words_token_ids == [[10, 13], [11, 13], [14]]
    assert p.engine.bad_words_token_ids == [] and p.engine.stop_token_ids == [4]  # p unchanged
    plain = SamplingParams(temperature=0.5)
    assert plain.engine_params(None) is plain.engine  # nothing to change: no copy
    with pytest.raises(ValueError, match="bad_words: a tokenizer is needed"):
        SamplingParams(bad_words=["x"]).engine_params(None)


def test_copy_equality_and_pickle():
    import copy
    import pickle

    p = SamplingParams(n=2, temperature=0.3, stop=["a"], logit_bias={3: 1.0}, bad_words=["w"], seed=5)
    for q in (copy.copy(p), copy.deepcopy(p), pickle.loads(pickle.dumps(p)), p.clone()):
        assert q == p and q is not p and q.engine is not p.engine
        q.max_tokens = 99
        assert p.max_tokens == 16 and q != p
    assert SamplingParams(stop="a") != SamplingParams(stop="b")
    assert "temperature=0.3" in repr(p) and "bad_words=('w',)" in repr(p)

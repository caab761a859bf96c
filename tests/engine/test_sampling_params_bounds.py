"""The sampling-parameter bounds are held once, in the engine (C++ SamplingParams::validate): the
runtime's SamplingParams stores its engine fields in a deepinfer._C.engine.SamplingParams and has
no bound of its own, so every refusal it makes is the engine's, surfaced with the field's name.
One documented exception: ``logprobs`` / ``prompt_logprobs`` = -1 (vLLM's whole vocabulary) is the
runtime's own value — the engine holds 0 and refuses -1 — and the runtime's refusal text for those
two fields says so ("or -1 for the whole vocabulary")."""

from __future__ import annotations

import ast
import inspect
import math

import pytest
from deepinfer.runtime import sampling_params as runtime_module
from deepinfer.runtime.sampling_params import SamplingParams
from deepinfer_engine import _engine as E

EPS = 1e-3
CASES = {
    "temperature": [0.0, -EPS, 1.5, math.inf, math.nan, 1e300],
    "top_p": [0.0, EPS, 1.0, 1.0 + EPS, math.nan, 1e-50],
    "min_p": [0.0, -EPS, 1.0, 1.0 + EPS, math.nan],
    "presence_penalty": [-2.0, -2.0 - EPS, 2.0, 2.0 + EPS, math.nan],
    "frequency_penalty": [-2.0, -2.0 - EPS, 2.0, 2.0 + EPS, math.inf],
    "repetition_penalty": [0.0, EPS, 1.0, 100.0, math.inf, math.nan, 1e-50],
    "max_tokens": [0, 1, 5, 2**31],
    "min_tokens": [-1, 0, 5, 6],      # max_tokens = 5
    "logprobs": [0, 1, 20, 21, -2],
    "prompt_logprobs": [0, 20, 21, -2],
    "logit_bias": [{3: 100.0}, {3: -100.0}, {3: 100.0 + EPS}, {3: -100.0 - EPS}, {3: math.inf}, {3: math.nan},
                   {3: 0.5}, {-3: 0.5}],
    "top_k": [-2, -1, 1, 50],          # 0: the runtime's alias of -1 (vLLM), mapped before the engine
    "n": [0, 1, 3],
    "seed": [0, -5, 2**63 - 1, 2**63],
    "stop_token_ids": [[1, 2], [-1], [2**31]],
    "allowed_token_ids": [[1], [], [-4]],
}


def _kw(field, value):
    return {field: value, "max_tokens": 5} if field == "min_tokens" else {field: value}


def _engine_error(field, value):
    try:
        E.SamplingParams(**_kw(field, value))
    except (ValueError, TypeError) as exc:
        return exc
    return None


def _python_error(field, value):
    try:
        SamplingParams(**_kw(field, value))
    except (ValueError, TypeError) as exc:
        return exc
    return None


@pytest.mark.parametrize("field", sorted(CASES))
def test_every_refusal_is_the_engines_named_by_the_field(field):
    refused = 0
    for value in CASES[field]:
        eng, py = _engine_error(field, value), _python_error(field, value)
        assert (eng is None) == (py is None), (field, value, eng, py)
        if eng is not None:
            refused += 1
            # the C++ message, as the runtime raises it: same type, "SamplingParams." + it
            expected = f"SamplingParams.{eng}"
            if field in ("logprobs", "prompt_logprobs"):  # the runtime's -1 named in the message
                expected = expected.replace("(or None)", "(or None, or -1 for the whole vocabulary)")
            assert type(py) is type(eng) and str(py) == expected, (field, value, str(py))
            assert str(eng).startswith(field), (field, value, eng)
    assert 0 < refused < len(CASES[field])  # each table has values on both sides of a bound


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_minus_one_is_the_runtimes_whole_vocabulary_and_the_engine_holds_zero(field):
    assert _engine_error(field, -1) is not None  # the engine alone refuses it
    p = SamplingParams(**{field: -1})
    assert getattr(p, field) == -1
    assert getattr(p._engine, field) == 0
    assert "or -1 for the whole vocabulary" in str(_python_error(field, -2))


def test_assignment_refusals_are_the_engines_too_and_change_nothing():
    p, e = SamplingParams(max_tokens=5), E.SamplingParams(max_tokens=5)
    for field, value in [("temperature", -1.0), ("min_tokens", 6), ("logprobs", 21), ("logit_bias", {1: 101.0}),
                         ("top_p", 0.0), ("n", True), ("stop_token_ids", "ab")]:
        with pytest.raises((ValueError, TypeError)) as eng:
            setattr(e, field, value)
        with pytest.raises(type(eng.value)) as py:
            setattr(p, field, value)
        assert str(py.value) == f"SamplingParams.{eng.value}"
    assert p == SamplingParams(max_tokens=5) and e == E.SamplingParams(max_tokens=5)


def _numbers(node):
    """Numeric literals under node (-x as one negative literal), list indices left out."""
    skip = {id(c) for n in ast.walk(node) if isinstance(n, ast.Subscript) for c in ast.walk(n.slice)}
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant):
            skip.add(id(n.operand))
            if id(n) not in skip:
                out.append(-n.operand.value)
        elif (isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool)
              and id(n) not in skip):
            out.append(n.value)
    return out


def test_the_runtime_module_holds_no_bound_of_its_own():
    tree = ast.parse(inspect.getsource(runtime_module))
    defaults = []  # a parameter's default value is not a bound
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in [*node.args.defaults, *node.args.kw_defaults]:
                if d is not None:
                    defaults += _numbers(d)
    body = _numbers(tree)
    for d in defaults:
        body.remove(d)
    # left: top_k's alias 0 -> -1 and the greedy threshold (the temperature sent as 0.0, not a bound)
    assert sorted(set(body)) == [-1, 0, 1e-5], body
    assert runtime_module.GREEDY_TEMPERATURE_THRESHOLD == 1e-5
    # and nothing of the engine's is duplicated there: each engine field is a property reading it
    for field in ("temperature", "logit_bias", "logprobs", "max_tokens", "stop_token_ids", "allowed_token_ids"):
        assert isinstance(inspect.getattr_static(SamplingParams, field), property)
    p = SamplingParams(temperature=0.25)
    assert "temperature" not in vars(p) and p.engine.temperature == 0.25


def test_vocabulary_checks_are_the_engines():
    s = E.Scheduler(64, block_size=4, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=64, vocab_size=100)
    for kw in (dict(stop_token_ids=[100]), dict(logit_bias={100: 1.0}), dict(allowed_token_ids=[5, 100]),
               dict(logprobs=20, bad_words_token_ids=[[3, 100]])):
        e = E.SamplingParams(**kw)
        with pytest.raises(ValueError) as by_scheduler:
            s.add_request("r", [1, 2, 3], e)
        with pytest.raises(ValueError) as by_params:
            e.validate(100)
        assert str(by_scheduler.value) == str(by_params.value) and "100" in str(by_params.value)
        if "bad_words_token_ids" not in kw:
            with pytest.raises(ValueError) as by_runtime:
                SamplingParams(**kw).check_vocab(100)
            assert str(by_runtime.value) == f"SamplingParams.{by_params.value}"
    assert s.num_unfinished_requests == 0


def test_the_boundaries_are_where_the_docs_say():
    assert _engine_error("logit_bias", {3: 100.0}) is None and _engine_error("logit_bias", {3: 100.5}) is not None
    assert _engine_error("logprobs", 20) is None and _engine_error("logprobs", 21) is not None
    assert str(_engine_error("temperature", -0.5)) == "temperature: -0.5 must be a finite value >= 0"

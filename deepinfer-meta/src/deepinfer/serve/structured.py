"""Structured outputs in the server: ``response_format`` (OpenAI) and vLLM's extra fields.

``structured_params(req)`` reads the request's one constraint — ``response_format``
(``json_object``, ``json_schema`` with ``strict``, vLLM's ``structural_tag``),
``structured_outputs`` (vLLM's object) or the
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` — into a
``StructuredOutputsParams``; ``check_grammar`` compiles it (cached) so an invalid schema is a 400
naming the field before any engine work.
"""

from __future__ import annotations

from typing import Any

from deepinfer.runtime.structured.params import StructuredOutputsParams
from deepinfer.serve.protocol import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_params(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's constraint or None, the request field it came from). A 400 naming the
    field for a malformed one, or for more than one."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        so = _response_format(rf)
        if so is not None:
            found.append(so)
    so_field = getattr(req, "structured_outputs", None)
    if so_field is not None:
        if not isinstance(so_field, dict):
            raise APIError(400, "structured_outputs must be an object (json, regex, choice, grammar, json_object or "
                                "structural_tag)",
                           "structured_outputs")
        found.append((_build(so_field, "structured_outputs"), "structured_outputs"))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((_build({kind: value}, name), name))
    if len(found) > 1:
        raise APIError(400, "only one of response_format, structured_outputs and guided_* may constrain the output, "
                            f"got {', '.join(f for _, f in found)}", found[1][1])
    return found[0] if found else (None, None)


def _build(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{param}: {str(exc).replace('StructuredOutputsParams', 'structured_outputs')}",
                       param) from None


def _response_format(rf: Any) -> tuple[StructuredOutputsParams, str] | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError(400, "response_format must be an object with a 'type'", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _build({"json_object": True}, "response_format"), "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError(400, "response_format.json_schema must be an object with 'name' and 'schema'",
                           "response_format.json_schema")
        schema = js.get("schema")
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
            return _build({"json_object": True}, "response_format"), "response_format"
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
        return _build({"json": schema}, "response_format.json_schema.schema"), "response_format.json_schema.schema"
    if kind == "structural_tag":  # vLLM's: {"type", "format"} or the older {"type", "structures", "triggers"}
        try:
            return StructuredOutputsParams(structural_tag=rf), "response_format"
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc).replace("StructuredOutputsParams.structural_tag", "response_format"),
                           "response_format") from None
    raise APIError(400, "response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                        f"got {kind!r}", "response_format.type")


def check_grammar(compiler: Any, so: StructuredOutputsParams, param: str) -> None:
    """Compile ``so`` with ``compiler`` (a ``GrammarCompiler``, cached); a 400 naming ``param``."""
    try:
        compiler.compile(so)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param) from None


def grammar_compiler(state: Any) -> Any:
    """The engine's grammar compiler when the engine runs in this process (its cache then serves
    the engine too), else one of the server's own over the same tokenizer (cached on ``state``)."""
    engine = getattr(state.llm, "engine", None)
    structured = getattr(engine, "structured", None)
    if structured is not None:
        return structured.compiler
    compiler = getattr(state, "_grammar_compiler", None)
    if compiler is None:
        from deepinfer.runtime.structured.backend import GrammarCompiler

        eos = getattr(state.tokenizer, "eos_token_id", None)
        compiler = GrammarCompiler(state.tokenizer, state.vocab_size, [] if eos is None else [eos])
        state._grammar_compiler = compiler
    return compiler

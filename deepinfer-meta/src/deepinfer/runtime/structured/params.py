"""``StructuredOutputsParams``: what a request's output must match (vLLM's names and meanings).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a list
of strings), ``grammar`` (an EBNF grammar in xgrammar's GBNF dialect), ``json_object=True`` (any
JSON object) or ``structural_tag`` (xgrammar's structural tag, as vLLM takes it) is set. Checked when the object is built: a wrong type is a TypeError, an empty
constraint or none/several constraints a ValueError, each naming the field. Whether a schema,
regex or grammar can be compiled is checked when the request is added (ValueError naming it).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output.

    Args:
        json: a JSON schema (dict, or a str holding it): the output is a JSON value valid
            against it.
        regex: the output matches this regular expression as a whole.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF, as llama.cpp and xgrammar write it; its start rule is
            ``root``): the output is a sentence of it.
        json_object: the output is a JSON object (any keys).
        structural_tag: xgrammar's structural tag (a dict, or its JSON text), as vLLM takes it:
            ``{"type": "structural_tag", "format": {...}}`` (xgrammar's formats: ``tag``,
            ``triggered_tags``, ``sequence``, ``json_schema``, ``const_string``, ...), or the
            older ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``: free
            text in which each structure begun by a trigger holds JSON valid against its schema.
        disable_any_whitespace: JSON without whitespace between tokens (vLLM's option);
            default False: the separators ", " and ": " (a model's usual JSON).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    _key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams: exactly one of json, regex, choice, grammar, "
                             f"json_object=True or structural_tag must be set, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"StructuredOutputsParams.json: not valid JSON text ({exc})") from None
            else:
                parsed = value
            if not isinstance(parsed, (dict, bool)):
                raise TypeError("StructuredOutputsParams.json must be a JSON schema (a dict or its JSON text), "
                                f"got {type(parsed).__name__}")
            text = _json.dumps(parsed)  # key order kept: properties are generated in the schema's order
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) \
                    or not all(isinstance(c, str) for c in value):
                raise TypeError(f"StructuredOutputsParams.choice must be a list of strings, got {value!r}")
            if not value or any(c == "" for c in value):
                raise ValueError(f"StructuredOutputsParams.choice must be non-empty strings, got {value!r}")
            object.__setattr__(self, "choice", tuple(value))
            text = _json.dumps(list(value))
        elif kind == "structural_tag":  # keys keep their order: a schema's properties are written in it
            text = _json.dumps(_structural_tag(value))
        elif kind == "json_object":
            if value is not True:
                raise TypeError(f"StructuredOutputsParams.json_object must be True or None, got {value!r}")
            text = ""
        else:
            if not isinstance(value, str):
                raise TypeError(f"StructuredOutputsParams.{kind} must be a str, got {type(value).__name__}")
            if not value:
                raise ValueError(f"StructuredOutputsParams.{kind} must not be empty")
            text = value
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError("StructuredOutputsParams.disable_any_whitespace must be a bool, "
                            f"got {self.disable_any_whitespace!r}")
        object.__setattr__(self, "_key", (kind, text))

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        return self._key[0]

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (the cache key): kind, its canonical text, whitespace."""
        return (*self._key, self.disable_any_whitespace)

    @property
    def schema(self) -> Any:
        """The JSON schema as a dict (``json`` only), else None."""
        if self.kind != "json":
            return None
        return _json.loads(self.json) if isinstance(self.json, str) else self.json


def _structural_tag(value: Any) -> dict[str, Any]:
    """A structural tag as a dict; TypeError / ValueError naming what is wrong with its shape
    (what is inside ``format`` is checked by xgrammar when it is compiled)."""
    where = "StructuredOutputsParams.structural_tag"
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{where}: not valid JSON text ({exc})") from None
    if not isinstance(value, dict):
        raise TypeError(f"{where} must be a structural tag (a dict or its JSON text), got {type(value).__name__}")
    if "structures" in value or "triggers" in value:  # the older form
        structures, triggers = value.get("structures"), value.get("triggers")
        if not isinstance(structures, list) or not structures or not all(
                isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, bool, type(None))) for s in structures):
            raise ValueError(f"{where}.structures must be a non-empty list of {{begin, schema, end}} objects "
                             "(begin and end strings, schema a JSON schema object)")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{where}.triggers must be a non-empty list of non-empty strings")
        unknown = sorted(set(value) - {"type", "structures", "triggers"})
    else:
        if not isinstance(value.get("format"), dict):
            raise ValueError(f"{where} must have a 'format' object ({{\"type\": \"structural_tag\", \"format\": "
                             "{...}}) or 'structures' and 'triggers'")
        unknown = sorted(set(value) - {"type", "format"})
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{where}.type must be 'structural_tag', got {value['type']!r}")
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}")
    return value

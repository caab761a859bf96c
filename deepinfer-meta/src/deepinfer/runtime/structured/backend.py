"""Grammar compilation on xgrammar: one compiler per tokenizer, each grammar compiled once.

xgrammar was chosen by measurement (``bench/structured_engines.py``, docs guide "Structured
outputs and tool calling"): on the default model's tokenizer it compiles a nested JSON schema in
tens of milliseconds and computes a step's token mask in microseconds, and it takes JSON
schemas, regular expressions and EBNF grammars alike.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from deepinfer.runtime.structured.params import StructuredOutputsParams

# xgrammar's character class for length-limited JSON strings, and JSON's own (no control characters)
_LENGTH_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\"\\\\\\x00-\\x1f]'
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
        raise ImportError("structured outputs need the xgrammar package: pip install xgrammar") from exc
    return xgrammar


def _hf_tokenizer(tokenizer: Any) -> Any:
    """A transformers fast tokenizer for xgrammar's vocabulary reader (the runtime's
    ``TextTokenizer`` is wrapped around its ``tokenizers`` backend)."""
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer,
                                   eos_token=getattr(tokenizer, "eos_token", None))


# xgrammar's native errors begin "[10:31:07] /project/cpp/x.cc:1318: Check failed: (...) is false: "
_NATIVE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def structural_tag_format(tag: dict[str, Any]) -> dict[str, Any]:
    """A structural tag in xgrammar's current form: the older ``structures`` / ``triggers``
    (vLLM's legacy response format) become a ``triggered_tags`` format of JSON-schema tags."""
    if "structures" not in tag:
        return {"type": "structural_tag", "format": tag["format"]}
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": True if s.get("schema") is None else s["schema"]}} for s in tag["structures"]]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": tags}}


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and a model vocabulary of
    ``vocab_size`` tokens (the logits' width); ``stop_token_ids`` end a completed output."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _import_xgrammar()
        self.xgr = xgr
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)  # end a completed output
        info = xgr.TokenizerInfo.from_huggingface(_hf_tokenizer(tokenizer), vocab_size=self.vocab_size,
                                                  stop_token_ids=sorted(set(stop_token_ids)) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached); ValueError naming the constraint when it
        cannot be compiled."""
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _json_schema_grammar(self, schema: Any, ws: dict[str, Any]) -> Any:
        """xgrammar's grammar of a JSON schema, with one repair: for a string with ``minLength`` /
        ``maxLength`` xgrammar 0.2.9 writes its characters as ``[^"\\\r\n]``, which lets raw
        control characters (a tab, U+0000-U+001F) into the string; JSON forbids them unescaped, so
        ``json.loads`` refused such an output although the grammar accepted it. The class is
        narrowed to JSON's (the rest of the grammar, escapes excluded as before, is unchanged)."""
        grammar = self.xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True, **ws)
        text = str(grammar)
        fixed = text.replace(_LENGTH_STRING_CHARS, _JSON_STRING_CHARS)
        return grammar if fixed == text else self.xgr.Grammar.from_ebnf(fixed)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        c, kind = self.compiler, params.kind
        try:
            if kind == "json":
                ws = {"any_whitespace": False, "separators": (",", ":")} if params.disable_any_whitespace \
                    else {"any_whitespace": False}
                return c.compile_grammar(self._json_schema_grammar(params.schema, ws))
            if kind == "json_object":
                return c.compile_json_schema(json.dumps({"type": "object"}), strict_mode=False,
                                             any_whitespace=False,
                                             **({"separators": (",", ":")} if params.disable_any_whitespace else {}))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(tuple(params.choice or ())))
            if kind == "structural_tag":
                return c.compile_structural_tag(json.dumps(structural_tag_format(json.loads(params.key[1]))))
            return c.compile_grammar(params.grammar)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}[kind]
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = _NATIVE_PREFIX.sub("", first)
            raise ValueError(f"structured_outputs.{kind}: invalid {what}: {first}") from None

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher (the state of one output) for ``params``."""
        return self.xgr.GrammarMatcher(self.compile(params))

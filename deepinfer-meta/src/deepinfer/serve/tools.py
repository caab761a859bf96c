"""Tool calling in chat: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and the tool calls
parsed from the model's output.

- ``tool_choice="auto"`` (the default with tools): the chat template is rendered with the tools
  and the output is parsed with the model family's format: Hermes (``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, Qwen2.5 / Qwen3 / Hermes templates) or Llama-3.x JSON
  (``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, calls separated
  by ``;``), chosen from the template.
- ``"required"`` and a named function are forced through structured outputs, as vLLM does: the
  output is a JSON array of ``{"name", "parameters"}`` objects (one item unless
  ``parallel_tool_calls``), or the named function's arguments object; both valid against the
  declared parameters.
- ``"none"``: the template is rendered without tools and nothing is parsed.

A stream sends text as ``content`` until a tool call may begin; the calls follow as OpenAI sends
them (the first delta of a call carries its ``id``, ``type`` and ``function.name``, then its
``arguments``), and the finish chunk says ``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from deepinfer.runtime.structured.params import StructuredOutputsParams
from deepinfer.serve.protocol import APIError

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolChoice:
    """A request's tools and what it asks of them (``mode``: auto, required, named or none)."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True
    parser: str = "hermes"  # or "llama3_json"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is rendered with (none for tool_choice="none")."""
        return None if self.mode == "none" else self.tools

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint that forces the call (required / named), else None."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.name)))
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                       "parameters": _parameters(t)},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def parser_for_template(template: Any) -> str:
    """The tool-call format a chat template asks for: llama3_json for Llama-3.x templates
    (``<|python_tag|>`` / ``ipython``), else hermes (Qwen2.5, Qwen3, Hermes)."""
    text = template if isinstance(template, str) else json.dumps(template)
    if HERMES_START in text:
        return "hermes"
    if PYTHON_TAG in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def tool_choice(req: Any, template: Any) -> ToolChoice | None:
    """The request's ToolChoice (None without tools); a 400 naming the field when malformed."""
    tools, choice = req.tools, req.tool_choice
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of {type: 'function', function: {...}} objects", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{type: 'function', function: {{name, description?, "
                                "parameters?}}}", f"tools[{i}]")
        if "parameters" in fn and fn["parameters"] is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           f"tools[{i}].function.parameters")
        names.append(fn["name"])
    parallel = req.parallel_tool_calls
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    out = ToolChoice(tools, "auto", parallel=parallel is not False, parser=parser_for_template(template))
    if choice is None or choice == "auto":
        return out
    if choice in ("none", "required"):
        out.mode = choice
        return out
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {type: 'function', function: "
                            "{name}}", "tool_choice")
    if fn["name"] not in names:
        raise APIError(400, f"tool_choice names the function {fn['name']!r}, which is not in tools "
                            f"({', '.join(names)})", "tool_choice")
    out.mode, out.name = "named", fn["name"]
    return out


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _json_values(text: str) -> list[Any] | None:
    """The JSON values of ``text`` (separated by whitespace or ';'), or None if it is not that."""
    dec, i = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def parse_tool_calls(choice: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output."""
    if choice.mode == "none":
        return text, []
    if choice.mode == "named":
        return None, [_call(str(choice.name), text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut by max_tokens: no complete call
            return text, []
        return None, [_call(c["name"], c.get("parameters", {})) for c in items if isinstance(c, dict) and "name" in c]
    if choice.parser == "llama3_json":
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        values = _json_values(body) if body.lstrip().startswith("{") else None
        if values and all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
            return None, [_call(v["name"], v.get("parameters", v.get("arguments", {}))) for v in values]
        return text, []
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES_CALL.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _holdback(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class ToolStream:
    """One choice's stream: content deltas until a tool call may begin, then the calls at the end."""

    choice: ToolChoice
    text: str = ""
    sent: int = 0  # characters of ``text`` sent as content
    calls: bool = False  # a tool call has begun: the rest is held for the parser
    pending: list[str] = field(default_factory=list)

    def feed(self, new: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        """(the deltas to send for ``new`` text, whether tool calls were sent)."""
        self.text += new
        deltas: list[dict[str, Any]] = []
        c = self.choice
        if c.mode in ("named", "required"):
            self.calls = True
        elif c.mode == "auto" and not self.calls:
            if c.parser == "llama3_json":
                head = self.text.lstrip()
                if head.startswith(("{", PYTHON_TAG)) or (not finished and (not head or PYTHON_TAG.startswith(head))):
                    self.calls = bool(head) and head.startswith(("{", PYTHON_TAG))
                    if not self.calls:
                        return deltas, False  # still undecided
            else:
                at = self.text.find(HERMES_START, self.sent)
                if at >= 0:
                    self.calls = True
                    if at > self.sent:
                        deltas.append({"content": self.text[self.sent:at]})
                    self.sent = at
        if c.mode == "none" or (c.mode == "auto" and not self.calls):
            end = len(self.text) if finished or c.parser != "hermes" else len(self.text) - _holdback(self.text, HERMES_START)
            if end > self.sent:
                deltas.append({"content": self.text[self.sent:end]})
                self.sent = end
            return deltas, False
        if not finished:
            return deltas, False
        content, calls = parse_tool_calls(c, self.text[self.sent:])
        if content:
            deltas.append({"content": content})
        for k, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
        return deltas, bool(calls)


def chat_tool_messages(messages: Any) -> Any:
    """The client's messages with their tool-call fields made template-ready: an assistant
    message's ``tool_calls`` (arguments JSON text parsed to objects, as chat templates expect)
    and a tool message's ``tool_call_id`` are kept; a 400 names a malformed one."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}] must have a function with a name",
                                   f"messages[{i}].tool_calls")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                                       f"messages[{i}].tool_calls") from None
                calls.append({"id": tc.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out

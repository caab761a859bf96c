"""Tool calling in chat: ``tools``, ``tool_choice``, ``parallel_tool_calls``, and the tool calls
parsed from the model's output.

- ``tool_choice="auto"`` (the default with tools): the chat template is rendered with the tools
  and the output is parsed with the server's ``--tool-call-parser``: Hermes (``<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>``, Qwen2.5 / Qwen3 / Hermes templates) or Llama-3.x JSON
  (``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, calls separated
  by ``;``); ``auto`` (the default) chooses from the template.
- ``"required"`` and a named function are forced through structured outputs, as vLLM does: the
  output is a JSON array of ``{"name", "parameters"}`` objects (one item unless
  ``parallel_tool_calls``), or the named function's arguments object; both valid against the
  declared parameters.
- ``"none"``: the template is rendered without tools and nothing is parsed.

The parsing itself is ``serve/tool_parsers.py``: a stream sends text as ``content`` until a call
begins, then each call as OpenAI sends it (a first delta with its ``index``, ``id``, ``type`` and
``function.name``, then its ``arguments`` in fragments as they are generated); the finish chunk
says ``tool_calls``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deepinfer.runtime.structured.params import StructuredOutputsParams
from deepinfer.serve.protocol import APIError
from deepinfer.serve.tool_parsers import HERMES_START, PYTHON_TAG, ToolCallParser, parse

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")  # --tool-call-parser (cli/serve.py repeats them)


@dataclass
class ToolChoice:
    """A request's tools and what it asks of them (``mode``: auto, required, named or none)."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True
    parser: str = "hermes"  # or "llama3_json"

    @property
    def fmt(self) -> str:
        """The tool-call format of the output (serve/tool_parsers.py)."""
        return self.mode if self.mode in ("required", "named") else self.parser

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


def tool_choice(req: Any, template: Any, parser: str = "auto") -> ToolChoice | None:
    """The request's ToolChoice (None without tools); a 400 naming the field when malformed.
    ``parser``: the server's --tool-call-parser ("auto": the chat template's format)."""
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
    out = ToolChoice(tools, "auto", parallel=parallel is not False, parser=parser_for_template(template) if parser == "auto" else parser)
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


def parse_tool_calls(choice: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished output."""
    if choice.mode == "none":
        return text, []
    return parse(choice.fmt, text, choice.name)


@dataclass
class ToolStream:
    """One choice's stream: content deltas until a tool call begins, then each call's first
    delta and its arguments in fragments as they are generated (``serve/tool_parsers.py``)."""

    choice: ToolChoice
    parser: ToolCallParser | None = None

    def __post_init__(self) -> None:
        if self.choice.mode != "none":
            self.parser = ToolCallParser(self.choice.fmt, self.choice.name)

    def feed(self, new: str, finished: bool) -> tuple[list[dict[str, Any]], bool]:
        """(the deltas to send for ``new`` text, whether tool calls were sent)."""
        if self.parser is None:
            return ([{"content": new}] if new else []), False
        return self.parser.feed(new, finished), self.parser.num_sent > 0


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

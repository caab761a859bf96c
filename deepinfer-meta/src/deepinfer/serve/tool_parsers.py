"""Tool calls read from a model's output as it is generated, one piece of text at a time.

``ToolCallParser(fmt)`` is fed the output's text and answers the stream deltas OpenAI sends:
text as ``content`` until a call begins, then per call a first delta with ``index``, ``id``,
``type`` and ``function.name`` (``arguments: ""``), then the call's ``arguments`` in fragments as
they are generated. The arguments are the model's own JSON text of the arguments value (not
re-serialized), so the fragments joined equal the whole response's ``arguments`` exactly.

Formats (``fmt``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3,
  Hermes); text before the first call is content, text between and after calls is dropped.
- ``llama3_json``: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``,
  calls separated by ``;``. An output that does not begin as a call is content.
- ``required``: a JSON array of ``{"name", "parameters"}`` objects (tool_choice="required").
- ``named``: the whole output is the named function's arguments (a named tool_choice).

A call's object is scanned character by character (strings, escapes, nesting), so its name is
known as soon as its value is complete, and whitespace the arguments may still end with is held
back until more follows. ``calls()`` after the whole output was fed gives the whole response's
calls: those whose object completed and whose arguments parse as JSON (a call cut by
``max_tokens`` was streamed as far as it went, but is not returned whole).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("arguments", "parameters")
FORMATS = ("hermes", "llama3_json", "required", "named")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def holdback(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass
class _Call:
    """One call object: where it starts, its name, where its arguments' value begins and ends."""

    start: int
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    args_string: bool = False  # the arguments are a JSON string (sent decoded, whole, at the end)
    done: bool = False  # the object closed
    bad: bool = False  # not a JSON object of the expected shape
    id: str = ""
    index: int = -1  # the stream's index, once the first delta was sent
    sent: int = 0  # characters of the arguments text sent

    def arguments(self, text: str) -> str | None:
        """The arguments' JSON text once the object closed ("{}" when it has none)."""
        if self.args_start is None:
            return "{}"
        if self.args_end is None:
            return None
        raw = text[self.args_start:self.args_end]
        if self.args_string:
            try:
                value = json.loads(raw)
            except ValueError:
                return None
            return value if isinstance(value, str) else None
        return raw


@dataclass
class _Scanner:
    """Scans one JSON object (the call) from ``pos``: its top-level keys, the "name" value and the
    span of the arguments value. ``depth`` counts open brackets (the call's own is 1)."""

    call: _Call
    pos: int
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    state: str = "open"  # open, key, colon, value, scalar, after
    key: str | None = None
    mark: int = 0  # where the current top-level key or value began
    scalar_end: int = 0
    in_args: bool = False  # the current top-level value is the arguments

    def scan(self, text: str) -> None:
        c = self.call
        i = self.pos
        n = len(text)
        while i < n and not (c.done or c.bad):
            ch = text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 1:
                        self._string_ends(text, i)
                continue
            if self.state == "open":
                if ch == "{":
                    self.depth, self.state = 1, "key"
                elif not ch.isspace():
                    c.bad = True
                continue
            if self.depth == 1 and self.state == "scalar" and (ch in ",}" or ch.isspace()):
                self._value_ends(text, self.mark, self.scalar_end)
            if ch.isspace():
                continue
            if ch == '"':
                self.in_str = True
                if self.depth == 1:
                    if self.state not in ("key", "value"):
                        c.bad = True
                    self.mark = i - 1
                continue
            if ch in "{[":
                if self.depth == 1:
                    if self.state != "value":
                        c.bad = True
                        continue
                    self._value_begins(i - 1)
                    self.state = "nested"
                self.depth += 1
                continue
            if ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_ends(text, self.mark, i)
                elif self.depth == 0:
                    if ch != "}" or self.state not in ("key", "after"):
                        c.bad = True
                    else:
                        c.done = True
                continue
            if self.depth > 1:
                continue
            if ch == ":" and self.state == "colon":
                self.state = "value"
            elif ch == "," and self.state == "after":
                self.state = "key"
            elif self.state == "value":  # a number, true, false or null
                self._value_begins(i - 1)
                self.state, self.scalar_end = "scalar", i
            elif self.state == "scalar":
                self.scalar_end = i
            else:
                c.bad = True
        self.pos = i

    def _string_ends(self, text: str, end: int) -> None:
        if self.state == "key":
            try:
                self.key = json.loads(text[self.mark:end])
            except ValueError:  # a bad escape
                self.call.bad = True
            self.state = "colon"
        else:  # a string value
            self._value_begins(self.mark)
            self._value_ends(text, self.mark, end)

    def _value_begins(self, at: int) -> None:
        self.mark = at
        c = self.call
        if self.key in ARGS_KEYS and c.args_start is None:
            c.args_start, c.args_string = at, False
            self.in_args = True
        else:
            self.in_args = False

    def _value_ends(self, text: str, start: int, end: int) -> None:
        c = self.call
        if self.in_args:
            c.args_end = end
            c.args_string = text[start] == '"'
            self.in_args = False
        elif self.key == "name" and c.name is None:
            try:
                value = json.loads(text[start:end]) if text[start] == '"' else None
            except ValueError:
                value = None
            if isinstance(value, str) and value:
                c.name = value
            else:
                c.bad = True
        self.state = "after"

    def args_safe_end(self, text: str) -> int | None:
        """How far the arguments' text may be sent now (trailing whitespace outside a string is
        held back: it may end the value, which does not include it)."""
        c = self.call
        if c.args_start is None or c.args_string:
            return None
        if c.args_end is not None:
            return c.args_end
        if text[c.args_start] == '"':
            return None
        end = self.pos
        if not self.in_str:
            while end > c.args_start and text[end - 1].isspace():
                end -= 1
        return end


@dataclass
class ToolCallParser:
    """One output's tool calls in format ``fmt`` (see the module), fed its text as it grows."""

    fmt: str
    name: str | None = None  # the function of fmt="named"
    text: str = ""
    phase: str = "start"
    pos: int = 0  # where scanning resumes
    content_sent: int = 0
    content_end: int | None = None  # hermes: where the first call began
    found: list[_Call] = field(default_factory=list)
    scanner: _Scanner | None = None
    num_sent: int = 0  # calls whose first delta was sent

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {self.fmt!r}; known: {', '.join(FORMATS)}")

    def feed(self, new: str, finished: bool = False) -> list[dict[str, Any]]:
        """The stream deltas for ``new`` text (``finished``: the output ends with it)."""
        # ``self.text += new`` copies the whole text (the attribute holds a second reference): a
        # long output cost O(its length) a token. Held by one local only, CPython grows it in place.
        text, self.text = self.text, ""
        text += new
        self.text = text
        out: list[dict[str, Any]] = []
        if self.fmt == "named":
            if self.num_sent == 0:
                call = _Call(0, name=self.name, args_start=0, id=call_id())
                self.found.append(call)
                self._header(call, out)
            call = self.found[0]
            if len(self.text) > call.sent:
                self._args(call, self.text[call.sent:], out)
                call.sent = len(self.text)
            if finished:
                call.done, call.args_end = True, len(self.text)
            return out
        while self._step(out, finished):
            pass
        return out

    # ---- one step of the format's state machine: True when it made progress ----------------
    def _step(self, out: list[dict[str, Any]], finished: bool) -> bool:
        text, phase = self.text, self.phase
        if phase == "object":
            return self._scan_object(out, finished)
        if phase == "text":  # llama3_json: the output is not a call: all of it is content
            self._content(len(text), out)
            return False
        if phase == "end":
            return False
        if phase == "seek":
            return self._seek(out, finished, {"llama3_json": ";", "required": ","}.get(self.fmt, ""))
        if self.fmt == "hermes":
            at = text.find(HERMES_START, self.pos)
            if at < 0:
                end = len(text) if finished else len(text) - holdback(text, HERMES_START)
                if phase == "start":
                    self._content(end, out)
                self.pos = max(self.pos, end)
                return False
            if phase == "start":
                self._content(at, out)
                self.content_end = at
            self.pos = at + len(HERMES_START)
            self.phase = "seek"
            return self._seek(out, finished, "")
        if self.fmt == "llama3_json" and phase == "start":
            i = self.pos
            while i < len(text) and text[i].isspace():
                i += 1
            rest = text[i:]
            if not finished and (rest == "" or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG)):
                return False  # still undecided
            if rest.startswith(PYTHON_TAG):
                i += len(PYTHON_TAG)
            elif not rest.startswith("{"):
                self.phase = "text"
                return True
            self.pos, self.phase = i, "seek"
            return True
        if self.fmt == "required" and phase == "start":
            i = self.pos
            while i < len(text) and text[i].isspace():
                i += 1
            if i == len(text):
                return False
            self.pos, self.phase = i + 1, ("seek" if text[i] == "[" else "end")
            return True
        return False

    def _seek(self, out: list[dict[str, Any]], finished: bool, separators: str) -> bool:
        """Before a call's object: skip whitespace (and separators); ``{`` begins the object."""
        text, i = self.text, self.pos
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        self.pos = i
        if i == len(text):
            if finished and self.fmt == "llama3_json" and self.num_sent == 0:
                self.phase = "text"
                return True
            return False
        if text[i] == "{":
            call = _Call(i)
            self.found.append(call)
            self.scanner = _Scanner(call, i)
            self.phase = "object"
            return True
        self._not_a_call()
        return True

    def _not_a_call(self) -> None:
        if self.fmt == "hermes":
            self.phase = "between"  # look for the next <tool_call>
        elif self.fmt == "llama3_json" and self.num_sent == 0:
            self.phase = "text"  # nothing was sent as a call: the whole output is content
        else:
            self.phase = "end"

    def _scan_object(self, out: list[dict[str, Any]], finished: bool) -> bool:
        sc = self.scanner
        assert sc is not None
        call = sc.call
        sc.scan(self.text)
        if call.name is not None and call.index < 0 and not call.bad:
            self._header(call, out)
        if call.index >= 0:
            end = sc.args_safe_end(self.text)
            if end is not None and call.args_start is not None and end > call.args_start + call.sent:
                self._args(call, self.text[call.args_start + call.sent:end], out)
                call.sent = end - call.args_start
        if not (call.done or call.bad):
            if finished and self.fmt == "llama3_json" and self.num_sent == 0:
                self.phase = "text"
                return True
            return False
        self.pos = sc.pos
        self.scanner = None
        if call.bad or call.name is None:
            call.bad = True
            self._not_a_call()
            return True
        if call.index >= 0 and (call.args_start is None or call.args_string):
            args = call.arguments(self.text)
            if args:
                self._args(call, args, out)
        self.phase = "between" if self.fmt == "hermes" else "seek"
        return True

    # ---- deltas ----------------------------------------------------------------------------
    def _content(self, end: int, out: list[dict[str, Any]]) -> None:
        if end > self.content_sent:
            out.append({"content": self.text[self.content_sent:end]})
            self.content_sent = end

    def _header(self, call: _Call, out: list[dict[str, Any]]) -> None:
        call.index, call.id = self.num_sent, call_id()
        self.num_sent += 1
        out.append({"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})

    @staticmethod
    def _args(call: _Call, fragment: str, out: list[dict[str, Any]]) -> None:
        out.append({"tool_calls": [{"index": call.index, "function": {"arguments": fragment}}]})

    # ---- the whole response ----------------------------------------------------------------
    def calls(self) -> list[dict[str, Any]]:
        """The complete calls (after the whole output was fed): name, arguments valid JSON."""
        out = []
        for c in self.found:
            if not c.done or c.bad or c.name is None:
                continue
            args = c.arguments(self.text)
            if args is None:
                continue
            if not c.args_string:
                try:
                    json.loads(args)
                except ValueError:
                    continue
            out.append({"id": c.id or call_id(), "type": "function", "function": {"name": c.name, "arguments": args}})
        return out

    def content(self, calls: list[dict[str, Any]]) -> str | None:
        """The whole response's content: the text before the first call (hermes; None if
        empty), None for the other formats, the whole text when no call was found."""
        if not calls:
            return self.text
        if self.fmt == "hermes" and self.content_end is not None:
            return self.text[:self.content_end].strip() or None
        return None


def parse(fmt: str, text: str, name: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a finished output in format ``fmt``."""
    p = ToolCallParser(fmt, name)
    p.feed(text, True)
    calls = p.calls()
    return p.content(calls), calls

"""OpenAI response bodies and stream chunks built from the engine thread's deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from deepinfer.serve.engine_thread import RequestDelta, SampleDelta
from deepinfer.serve.protocol import usage
from deepinfer.serve.tools import ToolChoice, ToolStream, parse_tool_calls


def sse_events(data: Any) -> bytes:
    """One SSE event; a list of chunks becomes their events in one write (orjson: no pydantic,
    no json module per chunk; a non-finite float is written as null); bytes are events made
    already (token_stream.py)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, list):
        return b"".join(b"data: " + orjson.dumps(d, option=orjson.OPT_NON_STR_KEYS) + b"\n\n" for d in data)
    return b"data: " + orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


class TokenStrings:
    """The text of single tokens (for logprobs), decoded once each."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.as_ids = as_ids

    def ids(self) -> TokenStrings:
        """The same tokenizer naming tokens "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        return TokenStrings(self._tokenizer, as_ids=True)

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return self.text(token_id)

    def text(self, token_id: int) -> str:
        """The token's text (what ``text_offset`` counts, whichever way tokens are named)."""
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tokenizer.decode([token_id])
        return s


#: what a logprob of -inf is reported as (vLLM's value): JSON has no infinity, and a token the
#: processed logits masked (``--logprobs-mode processed_logprobs``, top-k/top-p) has that logprob
LOGPROB_FLOOR = -9999.0


def _floored(lp: float | None) -> float | None:
    """``lp``, or ``LOGPROB_FLOOR`` below it (None and NaN pass unchanged)."""
    return LOGPROB_FLOOR if lp is not None and lp < LOGPROB_FLOOR else lp


def _floored_top(lp: dict[int, float], strings: TokenStrings) -> dict[str, float | None]:
    return {strings(k): _floored(v) for k, v in lp.items()}


def completion_logprobs(sample: SampleDelta, strings: TokenStrings, offset: int) -> dict[str, Any]:
    """The completions API's logprobs of a sample's new tokens (text offsets from ``offset``)."""
    lps = sample.logprobs or []
    tokens = [strings(t) for t in sample.token_ids]
    offsets = []
    for t in sample.token_ids:
        offsets.append(offset)
        offset += len(strings.text(t))
    return {"tokens": tokens, "token_logprobs": [_floored(lp[t]) for t, lp in zip(sample.token_ids, lps, strict=True)],
            "top_logprobs": [_floored_top(lp, strings) for lp in lps], "text_offset": offsets}


def prompt_logprobs(prompt_ids: list[int], lps: list[dict[int, float] | None] | None,
                    strings: TokenStrings) -> dict[str, Any]:
    """The completions API's logprobs of the prompt's tokens (echo): the first has none, as
    OpenAI and vLLM report it; text offsets from 0."""
    tokens = [strings(t) for t in prompt_ids]
    offsets, offset = [], 0
    for t in prompt_ids:
        offsets.append(offset)
        offset += len(strings.text(t))
    entries = list(lps or [])
    entries += [None] * (len(prompt_ids) - len(entries))
    return {"tokens": tokens,
            "token_logprobs": [None if lp is None else _floored(lp.get(t))
                               for t, lp in zip(prompt_ids, entries, strict=True)],
            "top_logprobs": [None if lp is None else _floored_top(lp, strings) for lp in entries],
            "text_offset": offsets}


def chat_logprobs(sample: SampleDelta, strings: TokenStrings, top: int) -> dict[str, Any]:
    """The chat API's logprobs of a sample's new tokens, with the ``top`` most likely each."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = strings(token_id)
        return {"token": s, "logprob": _floored(logprob), "bytes": list(s.encode("utf-8"))}

    content = []
    for t, lp in zip(sample.token_ids, sample.logprobs or [], strict=True):
        best = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in best]})
    return {"content": content}


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    text_len: int = 0
    logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echoed: bool = False  # the prompt's text (echo) is in ``text`` already
    token_ids: list[int] = field(default_factory=list)  # (return_token_ids) the tokens generated
    ids_sent: bool = False  # (return_token_ids, completions streams) its prompt's ids went out


class ResponseBuilder:
    """The choices of one HTTP request (``n`` per prompt), as a whole body or as SSE chunks.

    Choice index = prompt index * n + sample index, as the OpenAI API numbers them.
    """

    def __init__(self, kind: str, response_id: str, model: str, n: int, prompt_lens: list[int],
                 strings: TokenStrings, logprobs: int | None, echo: list[str] | None = None,
                 prompt_ids: list[list[int]] | None = None) -> None:
        self.kind, self.id, self.model, self.n = kind, response_id, model, n
        self.engine_id = response_id  # the engine's request ids start with it (unique, unlike a client's id)
        self.prompt_tokens = sum(prompt_lens)
        self.created = int(time.time())
        self.strings, self.top = strings, logprobs
        self.choices = [_Choice() for _ in range(n * len(prompt_lens))]
        # echo (completions): each prompt's text, its ids and its logprobs, put first in its choices
        self.echo, self.prompt_ids = echo, prompt_ids
        self._prompt_lps: dict[int, list[Any]] = {}
        self.cached_tokens = 0
        self.tools: ToolChoice | None = None  # chat with tools: tool calls parsed from the text
        self._tool_streams: dict[int, ToolStream] = {}
        self.continuous_usage = False  # (stream_options.continuous_usage_stats) every chunk's usage so far
        # echo with max_tokens 0 (OpenAI's legacy scoring of a prompt): the prompt alone; the one token
        # the engine samples to get there is not returned, nor counted
        self.echo_only = False
        self.token_ids_of: list[list[int] | None] | None = None  # (vLLM's return_token_ids) each prompt's ids

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def _echo(self, tag: int, c: _Choice) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text (and logprobs) to put first in choice ``c`` of prompt ``tag``, once."""
        if self.echo is None or c.echoed:
            return "", None
        c.echoed = True
        text = self.echo[tag]
        lp = None
        if self.top is not None and self.prompt_ids is not None:
            lp = prompt_logprobs(self.prompt_ids[tag], self._prompt_lps.get(tag), self.strings)
        return text, lp

    def _logprobs(self, sample: SampleDelta, choice: _Choice) -> dict[str, Any] | None:
        if self.top is None or sample.logprobs is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(sample, self.strings, self.top)
        return completion_logprobs(sample, self.strings, choice.text_len)

    def apply(self, delta: RequestDelta) -> list[tuple[int, SampleDelta, dict[str, Any] | None, bool]]:
        """Record a delta; returns (choice index, sample, its logprobs, finishes now) per sample."""
        out = []
        if delta.prompt_logprobs:
            self._prompt_lps.setdefault(delta.tag, []).extend(delta.prompt_logprobs)
        if delta.finished:
            self.cached_tokens += delta.cached_tokens
        for s in delta.samples:
            if self.echo_only:
                s = SampleDelta(s.index, [], "", None if s.logprobs is None else [], s.finish_reason, s.stop_reason)
            idx = delta.tag * self.n + s.index
            c = self.choices[idx]
            echo, echo_lp = self._echo(delta.tag, c)
            if echo:
                c.text.append(echo)
                c.text_len += len(echo)
            lp = self._logprobs(s, c)
            if echo_lp is not None:
                lp = {k: echo_lp[k] + (lp[k] if lp is not None else []) for k in echo_lp}
            if echo:
                s = SampleDelta(s.index, s.token_ids, echo + s.text, s.logprobs, s.finish_reason, s.stop_reason)
            finishes = s.finish_reason is not None and c.finish_reason is None
            c.text.append(s.text[len(echo):])
            c.text_len += len(s.text) - len(echo)
            c.num_tokens += len(s.token_ids)
            if self.token_ids_of is not None:
                c.token_ids += s.token_ids
            if lp is not None:
                if c.logprobs is None:
                    c.logprobs = {k: [] for k in lp}
                for k, v in lp.items():
                    c.logprobs[k].extend(v)
            if finishes:
                c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason
            out.append((idx, s, lp, finishes))
        return out

    # ---- whole responses -------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = c.finish_reason
                if self.tools is not None:
                    content, calls = parse_tool_calls(self.tools, text)
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    if calls and reason == "stop":
                        reason = "tool_calls"
                choices.append({"index": i, "message": message, "logprobs": c.logprobs, "finish_reason": reason,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": c.logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if self.token_ids_of is not None:  # (vLLM's places: the prompt's per choice, or once for chat)
                if self.kind != "chat":
                    choices[-1]["prompt_token_ids"] = self.token_ids_of[i // self.n]
                choices[-1]["token_ids"] = c.token_ids
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices, "usage": self.usage()}
        if self.token_ids_of is not None and self.kind == "chat":
            out["prompt_token_ids"] = self.token_ids_of[0]
        return out

    # ---- stream chunks ---------------------------------------------------------------------
    def chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        c: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": choices}
        if include_usage:
            c["usage"] = self.usage() if self.continuous_usage else None
        return c

    def text_chunk_template(self, include_usage: bool) -> tuple[bytes, bytes] | None:
        """The SSE event of choice 0's new text, not finishing, as (head, tail): head + the text's
        JSON string + tail is byte for byte ``delta_chunks``' event (token_stream.py fills it).
        None in the odd case that the marker shows elsewhere (a model named "\\x00")."""
        mark = "\x00"  # a character JSON always escapes, so it is found once and only as the text
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": mark}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": mark, "logprobs": None, "finish_reason": None, "stop_reason": None}
        event = sse_events(self.chunk([choice], include_usage))
        if event.count(b'"\\u0000"') != 1:
            return None
        head, _, tail = event.partition(b'"\\u0000"')
        return head, tail

    def role_chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role (return_token_ids: the prompt's
        ids in the first chunk)."""
        chunks = [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], include_usage) for i in range(len(self.choices))]
        if self.token_ids_of is not None and chunks:
            chunks[0]["prompt_token_ids"] = self.token_ids_of[0]
            for c in chunks:
                c["choices"][0]["token_ids"] = []
        return chunks

    def delta_chunks(self, delta: RequestDelta, include_usage: bool) -> list[dict[str, Any]]:
        """One chunk per sample with new text or a finish reason (return_token_ids: its new token
        ids in the first, and a completions choice's prompt ids in its first chunk of all)."""
        chunks: list[dict[str, Any]] = []
        ids = self.token_ids_of
        for idx, s, lp, finishes in self.apply(delta):
            start = len(chunks)
            if not s.text and not finishes and lp is None and not (ids is not None and s.token_ids):
                continue  # e.g. a possible stop string held back (kept when it has token ids to return)
            self._sample_chunks(chunks, idx, s, lp, finishes, include_usage)
            if ids is None:
                continue
            c = self.choices[idx]
            for k, ch in enumerate(chunks[start:]):
                choice = ch["choices"][0]
                choice["token_ids"] = s.token_ids if k == 0 else []
                if self.kind != "chat" and not c.ids_sent:
                    choice["prompt_token_ids"] = ids[idx // self.n]
                    c.ids_sent = True
        return chunks

    def _sample_chunks(self, chunks: list[dict[str, Any]], idx: int, s: SampleDelta, lp: dict[str, Any] | None,
                       finishes: bool, include_usage: bool) -> None:
        """Append the chunks of one sample's delta (``delta_chunks``)."""
        reason = self.choices[idx].finish_reason if finishes else None
        stop = self.choices[idx].stop_reason if finishes else None
        if self.kind == "chat" and self.tools is not None:
            stream = self._tool_streams.setdefault(idx, ToolStream(self.tools))
            deltas, called = stream.feed(s.text, finishes)
            if not deltas and (lp is not None or (self.token_ids_of is not None and s.token_ids)):
                deltas = [{}]  # text held back (a possible call): its logprobs and ids still go
            for k, d in enumerate(deltas):
                chunks.append(self.chunk([{"index": idx, "delta": d, "logprobs": lp if k == 0 else None,
                                           "finish_reason": None}], include_usage))
            if finishes:
                if called and reason == "stop":
                    reason = "tool_calls"
                chunks.append(self.chunk([{"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason,
                                           "stop_reason": stop}], include_usage))
            return
        if self.kind == "chat":  # as OpenAI: the text, then a chunk of its own for the finish
            if s.text or lp is not None or (self.token_ids_of is not None and s.token_ids):
                chunks.append(self.chunk([{"index": idx, "delta": {"content": s.text} if s.text else {},
                                           "logprobs": lp, "finish_reason": None}], include_usage))
            if finishes:
                chunks.append(self.chunk([{"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason,
                                           "stop_reason": stop}], include_usage))
            return
        chunks.append(self.chunk([{"index": idx, "text": s.text, "logprobs": lp, "finish_reason": reason,
                                   "stop_reason": stop}], include_usage))

    def usage_chunk(self) -> dict[str, Any]:
        c = self.chunk([], False)
        c["usage"] = self.usage()
        return c

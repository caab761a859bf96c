"""The OpenAI request bodies the server accepts, their mapping to ``SamplingParams``, and the
OpenAI error shape.

Request bodies are pydantic models that forbid unknown fields, so every parameter is either
honoured or refused with a 400 naming it. Sampling values are checked by ``SamplingParams``
itself (one place for every rule); its errors are reported under the API's parameter name.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer.runtime.beam_search import BeamSearchParams
from deepinfer.runtime.sampling_params import SamplingParams


class APIError(Exception):
    """An error returned to the client as ``{"error": {message, type, param, code}}``."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
        413: "invalid_request_error", 415: "invalid_request_error", 500: "internal_server_error",
        503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _printable(self.message), "type": self.TYPES.get(self.status, "error"),
                          "param": None if self.param is None else _printable(self.param), "code": self.code}}


def _printable(text: str) -> str:
    """``text`` with lone surrogates (from the request, e.g. a field's name) as ``\\udXXX``: an
    error body must encode as UTF-8 whatever the request held."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


#: a client's request id (the X-Request-Id header, vLLM's request_id field): printable ASCII
#: without spaces, so that it goes into a log line and a response header as it is
MAX_REQUEST_ID_CHARS = 128


def client_request_id(header: str | None, field: str | None) -> str | None:
    """The request id a client gave (the X-Request-Id header first, then the body's
    ``request_id``, as vLLM reads them), or None; a 400 naming it when it is empty, longer than
    ``MAX_REQUEST_ID_CHARS`` or holds anything but printable ASCII without spaces."""
    value, param = (header, "X-Request-Id") if header is not None else (field, "request_id")
    if value is None:
        return None
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS or not all("!" <= c <= "~" for c in value):
        raise APIError(400, f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters without "
                            f"spaces, got {_printable(value)!r:.60}", "request_id")
    return value


def check_text(text: str, param: str) -> str:
    """A 400 naming ``param`` for text that is not valid Unicode (a lone surrogate, which JSON's
    ``\\ud800`` escapes can carry and no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid Unicode text ({exc.reason} at index {exc.start})", param) from None
    return text


# Fields of the OpenAI API this server does not implement: refused with a 400 naming them
# unless they carry their "off" value.
_UNSUPPORTED_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "logit_processors": (None,),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk has the usage so far


class _SamplingBody(_Body):
    """Fields shared by completions and chat completions (vLLM's extras included)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (exact, unambiguous)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (tokenized by the engine, as in vLLM)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    priority: int = 0  # smaller first, with --scheduling-policy priority (vLLM's)
    cache_salt: str | None = None  # vLLM's: prefix-cached KV is shared only by requests of the same salt
    request_id: str | None = None  # vLLM's: the response's id is "cmpl-<request_id>" (or the X-Request-Id header's)
    use_beam_search: bool = False  # vLLM's: the n choices are the n best beams (serve/beam_search.py)
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / length ** length_penalty
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    # structured outputs (serve/structured.py): OpenAI's response_format and vLLM's extras
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # tool calling (serve/tools.py; chat only)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # refused unless off (see _UNSUPPORTED_OFF_VALUES)
    best_of: Any = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_SamplingBody):
    prompt: Any = None
    prompt_embeds: Any = None  # vLLM's: base64 of torch.save(tensor[L, hidden]) (or a list); --enable-prompt-embeds
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False  # the prompt's text first in each choice (with logprobs: its tokens' logprobs first)
    add_special_tokens: bool = True  # a text prompt's tokens with the tokenizer's BOS etc. (vLLM's)
    suffix: Any = None


class ChatCompletionRequest(_SamplingBody):
    messages: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply continues the last message's text
    echo: bool = False  # vLLM's: the reply's content starts with the last message's, when that is the assistant's
    chat_template_kwargs: Any = None  # vLLM's: more variables for the chat template (enable_thinking=false, ...)
    documents: Any = None  # vLLM's: [{"title": ..., "text": ...}] for a template that renders documents (RAG)
    chat_template: str | None = None  # vLLM's: a template of the request's own (--trust-request-chat-template)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    metadata: dict[str, str] | None = None  # stored nowhere; accepted as OpenAI does without store
    store: bool = False


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Any = None
    documents: Any = None
    chat_template: str | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


_JSON = msgspec.json.Decoder()


def loads_json(body: bytes) -> Any:
    """``json.loads(body)``: the same value, or the same exception.

    msgspec's decoder reads a body first (a prompt of 128 token ids: ~2 us against ~9). It
    accepts only strict JSON that ``json.loads`` reads to the same value (big integers stay
    ints); whatever it refuses (NaN, Infinity, lone surrogates, a number out of float range,
    too deep, not UTF-8, malformed) goes to ``json.loads``, which reads or refuses it as before."""
    try:
        return _JSON.decode(body)
    except (ValueError, RecursionError):  # (msgspec.DecodeError is a ValueError)
        return json.loads(body)


def parse_body(model: type[_Body], body: Any) -> Any:
    """Validate a JSON body; a 400 names the first offending parameter."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        param = ".".join(loc) if loc else None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"unrecognized request argument: {param}", param) from None
        where = f"{param}: " if param else ""
        raise APIError(400, f"{where}{err['msg']} (got {err.get('input')!r:.100})", param) from None
    values = req.__dict__  # (the fields; a name the model lacks reads as None, its off value)
    for name, off in _UNSUPPORTED_OFF_VALUES.items():
        if name in values and values[name] not in off:
            raise APIError(400, f"{name} is not supported by this server", name)
    if req.__class__ is CompletionRequest:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                raise APIError(400, f"{name} is only supported by /v1/chat/completions", name)
    if req.__class__ is ChatCompletionRequest and req.store:
        raise APIError(400, "store is not supported by this server", "store")
    if values.get("stream_options") is not None and not values.get("stream", False):
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    return req


_FIELD = re.compile(r"SamplingParams\.(\w+)")


def sampling_params(req: _SamplingBody, max_tokens: int, logprobs: int | None,
                    renames: dict[str, str], prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams; a ValueError/TypeError becomes a 400 naming the API field
    (``renames`` maps SamplingParams names to this endpoint's, e.g. logprobs -> top_logprobs)."""
    bias: dict[int, float] | None = None
    if req.logit_bias is not None:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    kwargs: dict[str, Any] = dict(
        n=req.n, stop=req.stop, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
        stop_token_ids=req.stop_token_ids, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words)
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        value = getattr(req, name)
        kwargs[name] = default if value is None else value
    for name, asked in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if asked == -1:  # the offline API's whole vocabulary; OpenAI's API stops at 20
            raise APIError(400, f"{renames.get(name, name)}: -1 (the whole vocabulary) is only offline "
                                "(LLM(max_logprobs=-1)); the server returns at most 20", renames.get(name, name))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        m = _FIELD.search(str(exc))
        field = m.group(1) if m else None
        if field and field.startswith("logit_bias"):
            field = "logit_bias"
        param = renames.get(field, field) if field else None
        raise APIError(400, str(exc).replace("SamplingParams.", ""), param) from None


# What a beam search does not use: a request setting one of these to anything but a value that
# changes nothing is a 400, rather than a search that silently ignores it (name, neutral values).
_NOT_IN_BEAM_SEARCH: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("top_p", (None, 1.0)), ("top_k", (None, -1, 0)), ("min_p", (None, 0.0)), ("stop", (None, [])),
    ("stop_token_ids", (None, [])), ("presence_penalty", (None, 0.0)), ("frequency_penalty", (None, 0.0)),
    ("repetition_penalty", (None, 1.0)), ("logit_bias", (None, {})), ("min_tokens", (0,)),
    ("allowed_token_ids", (None,)), ("bad_words", (None, [])), ("include_stop_str_in_output", (False,)),
    ("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("return_tokens_as_token_ids", (False,)),
    ("echo", (False,)), ("prompt_embeds", (None,)), ("response_format", (None, {"type": "text"})),
    ("structured_outputs", (None,)), ("guided_json", (None,)), ("guided_regex", (None,)),
    ("guided_choice", (None,)), ("guided_grammar", (None,)), ("tools", (None, [])), ("tool_choice", (None, "none")))


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``neutral`` (a bool equals only a bool: ``logprobs: 0`` asks
    for logprobs although ``0 == False``; an int equals the float of the same value)."""
    return any(value is n or (isinstance(value, bool) == isinstance(n, bool) and value == n) for n in neutral)


def beam_search_params(req: _SamplingBody, params: SamplingParams) -> BeamSearchParams | None:
    """vLLM's ``use_beam_search``: the search's parameters (``n`` beams, 1 to 10; the request's
    ``max_tokens``, ``ignore_eos``, ``temperature`` and ``length_penalty``), or None without it.
    A 400 names a field the search does not use, and ``length_penalty`` without a search."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise APIError(400, "length_penalty applies to beam search only (set use_beam_search)", "length_penalty")
        return None
    for name, neutral in _NOT_IN_BEAM_SEARCH:
        if not _neutral(getattr(req, name, neutral[0]), neutral):
            raise APIError(400, f"{name} is not used by beam search (use_beam_search): leave it out", name)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens, ignore_eos=req.ignore_eos,
                                temperature=params.temperature, length_penalty=req.length_penalty)
    except (TypeError, ValueError) as exc:
        text = str(exc).replace("BeamSearchParams.", "")
        param = "n" if "beam_width" in text else "length_penalty" if "length_penalty" in text else None
        raise APIError(400, text.replace("beam_width", "n (the beam width)"), param) from None


def check_stop(stop: str | list[str] | None, max_stop_strings: int) -> None:
    """A 400 when ``stop`` lists more strings than the server takes (OpenAI: 4)."""
    if isinstance(stop, list) and len(stop) > max_stop_strings:
        raise APIError(400, f"stop may hold at most {max_stop_strings} strings, got {len(stop)} (the server's "
                            "--max-stop-strings sets the limit)", "stop")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as the chat template takes them: role + text content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"{where} must be an object with a string 'role'", where)
        unknown = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
        if unknown:
            raise APIError(400, f"{where}.{sorted(unknown)[0]} is not supported by this server",
                           f"{where}.{sorted(unknown)[0]}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}]: only text parts are supported",
                                   f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        for key in ("tool_calls", "tool_call_id"):  # tool calling (serve/tools.chat_tool_messages)
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


_INT_ONLY = {int}


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: a string, strings, token ids, or lists of ids."""
    def is_ids(x: Any) -> bool:  # (a JSON body's ints are exactly int; True and False are bool)
        return isinstance(x, list) and bool(x) and set(map(type, x)) <= _INT_ONLY

    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                       f"token-id lists, got {prompt!r:.80}", "prompt")
    for p in prompts:
        if isinstance(p, str) and not p:
            raise APIError(400, "prompt must not be empty", "prompt")
    return prompts


def decode_prompt_embeds(value: Any, hidden_size: int, max_model_len: int) -> list[Any]:
    """The tensors of a completions request's ``prompt_embeds`` (vLLM's: a base64 string of
    ``torch.save(tensor[L, hidden])``, or a list of them), each checked; a 400 naming the item
    otherwise. Hostile input: the encoded size is bounded first (a full context of float32 rows
    plus torch.save's framing), and ``torch.load`` runs with ``weights_only=True`` (tensors and
    plain containers only, no code)."""
    import base64
    import binascii
    import io

    import torch

    from deepinfer.runtime.engine.prompt_embeds import check_prompt_embeds

    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise APIError(400, "prompt_embeds must be a base64 string of torch.save(tensor) or a non-empty list of them",
                       "prompt_embeds")
    cap = 4 * max_model_len * hidden_size + (1 << 16)
    out = []
    for i, text in enumerate(items):
        where = f"prompt_embeds[{i}]" if isinstance(value, list) else "prompt_embeds"
        if len(text) > cap // 3 * 4 + 8:
            raise APIError(400, f"{where} is larger than a float32 tensor of max_model_len={max_model_len} x "
                                f"{hidden_size} rows may be ({cap} bytes)", "prompt_embeds")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{where} is not valid base64", "prompt_embeds") from None
        try:
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - any unreadable payload is the client's
            raise APIError(400, f"{where} is not a torch.save'd tensor ({type(exc).__name__})",
                           "prompt_embeds") from None
        try:
            out.append(check_prompt_embeds(tensor, hidden_size, where))
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), "prompt_embeds") from None
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


#: the chat template's arguments that a request sets with fields of their own
_OWN_TEMPLATE_ARGS = {"tokenize": None, "conversation": "messages", "messages": "messages",
                      "add_generation_prompt": "add_generation_prompt",
                      "continue_final_message": "continue_final_message", "tools": "tools"}


def chat_template_kwargs(req: Any) -> dict[str, Any]:
    """The chat template's extra arguments of a chat or tokenize request (vLLM's
    ``chat_template_kwargs``, ``documents`` and ``continue_final_message``), checked: a 400 for a
    value that is not an object (documents: a list of objects of strings), a key that is an
    argument with a field of its own, or both ``continue_final_message`` and
    ``add_generation_prompt``."""
    kwargs = req.chat_template_kwargs
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise APIError(400, f"chat_template_kwargs must be an object, got {type(kwargs).__name__}",
                       "chat_template_kwargs")
    for key in kwargs:
        if key in _OWN_TEMPLATE_ARGS:
            field = _OWN_TEMPLATE_ARGS[key]
            use = f" (set the request's {field!r} instead)" if field else ""
            raise APIError(400, f"chat_template_kwargs must not set {key!r}{use}", "chat_template_kwargs")
    if not isinstance(req.continue_final_message, bool):
        raise APIError(400, "continue_final_message must be a boolean", "continue_final_message")
    kwargs = dict(kwargs)
    docs = req.documents
    if docs is not None:
        if not isinstance(docs, list) or not all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in docs):
            raise APIError(400, "documents must be a list of objects whose values are strings", "documents")
        if "documents" in kwargs:
            raise APIError(400, "documents given twice (the field and chat_template_kwargs)", "documents")
        kwargs["documents"] = docs
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true (the "
                                "reply would start a new turn; add_generation_prompt defaults to true: set it to "
                                "false)", "continue_final_message")
        kwargs["continue_final_message"] = True
    return kwargs


def check_conversation(messages: list[dict[str, str]]) -> None:
    """A 400 for a conversation no reply can follow: one ending in two assistant messages (the
    model would be asked to answer itself; join them into one message)."""
    if len(messages) >= 2 and messages[-1]["role"] == messages[-2]["role"] == "assistant":
        i = len(messages) - 2
        raise APIError(400, f"messages[{i}] and messages[{i + 1}] are both assistant messages: a conversation "
                            "cannot end in two assistant turns (join them into one message)", "messages")


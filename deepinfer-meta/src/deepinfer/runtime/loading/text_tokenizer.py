"""The runtime's tokenizer: ``tokenizers`` (the Rust library transformers' fast tokenizers wrap)
plus jinja2 for chat templates, without importing transformers.

Importing transformers and building its tokenizer costs 0.8-1.2 s, most of a warm ``LLM()`` of a
small model; ``tokenizers.Tokenizer.from_file`` takes under 0.1 s. To give the same ids, text and
chat prompts as the transformers tokenizer the model would load, a ``TextTokenizer`` is a
snapshot of that tokenizer: its Rust backend as transformers left it after loading (added
tokens, post-processor) and the few settings its Python side applies (special tokens,
``clean_up_tokenization_spaces``, ``split_special_tokens``, the chat template). The snapshot is
taken once, when transformers first loads the model's tokenizer, and kept under
``$DEEPINFER_CACHE`` (see ``tokenizer_loader.load_text_tokenizer``). Chat templates are rendered
in the jinja environment transformers builds (``transformers.utils.chat_template_utils``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

FORMAT = 1  # of meta.json; a snapshot of another format is rebuilt
BACKEND_FILE = "tokenizer.json"
META_FILE = "meta.json"

# transformers methods whose behaviour the snapshot reproduces: a tokenizer class overriding any
# of them (a model-specific tokenizer) is used as it is, through transformers
_MIRRORED = ("__call__", "encode", "_encode_plus", "decode", "_decode", "apply_chat_template",
             "get_chat_template", "convert_ids_to_tokens", "clean_up_tokenization")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Encoding:
    """What ``tokenizer(text)`` returns: the ids as ``.input_ids`` (or ``["input_ids"]``)."""

    __slots__ = ("input_ids",)

    def __init__(self, input_ids: list[int]) -> None:
        self.input_ids = input_ids

    def __getitem__(self, key: str) -> list[int]:
        if key != "input_ids":
            raise KeyError(key)
        return self.input_ids


class TextTokenizer:
    """Encode, decode and chat-template formatting of one model, equal to its transformers tokenizer.

    ``backend_tokenizer`` is the ``tokenizers.Tokenizer``; ``chat_template`` the template (a str,
    a dict of named templates, or None); ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` /
    ``unk_token_id`` and the token strings as in transformers.
    """

    def __init__(self, backend: Any, meta: Mapping[str, Any]) -> None:
        backend.no_padding()  # transformers encodes single texts without padding or truncation
        backend.no_truncation()
        backend.encode_special_tokens = bool(meta["split_special_tokens"])
        self._backend = backend
        self._meta = dict(meta)
        self.special_tokens_map: dict[str, str] = dict(meta["special_tokens_map"])
        ids = meta["special_token_ids"]
        self.bos_token_id: int | None = ids.get("bos_token_id")
        self.eos_token_id: int | None = ids.get("eos_token_id")
        self.pad_token_id: int | None = ids.get("pad_token_id")
        self.unk_token_id: int | None = ids.get("unk_token_id")
        self.all_special_ids: list[int] = list(meta["all_special_ids"])
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.clean_up_tokenization_spaces = bool(meta["clean_up_tokenization_spaces"])
        # the transformers tokenizer this one was made from, when the process has it (LLM.tokenizer
        # then needs no second load)
        self.transformers_tokenizer: Any = None

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def mirrors(tok: Any) -> bool:
        """Whether a snapshot of the transformers tokenizer ``tok`` behaves exactly like it: a
        tokenizers-backed tokenizer whose encode/decode/chat methods are transformers' own
        (transformers 5; older versions decode and fill templates differently: not mirrored)."""
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:
            return False

        return isinstance(tok, TokenizersBackend) and all(
            getattr(type(tok), name) is getattr(TokenizersBackend, name) for name in _MIRRORED)

    @classmethod
    def from_transformers(cls, tok: Any) -> TextTokenizer:
        """The snapshot of a transformers tokenizer (``mirrors(tok)`` must hold)."""
        from tokenizers import Tokenizer

        model = type(tok.backend_tokenizer.model).__name__
        # transformers skips the clean-up for BPE models (it would eat real spaces) unless forced
        clean = bool(tok.clean_up_tokenization_spaces) and (
            model != "BPE" or bool(getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                                           False)))
        meta = {
            "format": FORMAT,
            "special_tokens_map": {k: str(v) for k, v in tok.special_tokens_map.items()},
            "special_token_ids": {name: getattr(tok, name) for name in
                                  ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")},
            "all_special_ids": [int(i) for i in tok.all_special_ids],
            "chat_template": tok.chat_template,
            "clean_up_tokenization_spaces": clean,
            "split_special_tokens": bool(tok.split_special_tokens),
        }
        text = cls(Tokenizer.from_str(tok.backend_tokenizer.to_str()), meta)
        text.transformers_tokenizer = tok
        return text

    @classmethod
    def load(cls, folder: str) -> TextTokenizer:
        """A snapshot saved by ``save``; OSError/ValueError when missing, damaged or of another format."""
        from tokenizers import Tokenizer

        with open(os.path.join(folder, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{folder}: not a text-tokenizer snapshot of format {FORMAT}")
        try:
            backend = Tokenizer.from_file(os.path.join(folder, BACKEND_FILE))
        except Exception as exc:  # tokenizers raises a plain Exception on a bad file
            if isinstance(exc, OSError):
                raise
            raise ValueError(f"{folder}: unreadable snapshot ({exc})") from exc
        try:
            return cls(backend, meta)
        except (KeyError, TypeError, AttributeError) as exc:  # fields missing or of the wrong type
            raise ValueError(f"{folder}: damaged snapshot ({exc!r})") from exc

    def save(self, folder: str) -> None:
        """Write the snapshot into ``folder`` (created)."""
        os.makedirs(folder, exist_ok=True)
        self._backend.save(os.path.join(folder, BACKEND_FILE))
        with open(os.path.join(folder, META_FILE), "w", encoding="utf-8") as f:
            json.dump(self._meta, f)

    # ---- what the runtime uses -------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (its ``decode`` is the detokenizer's fast path)."""
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary (without added tokens), as transformers counts it."""
        return int(self._backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens=add_special_tokens))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's special tokens if ``add_special_tokens``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        # encode_batch, unlike encode, releases the GIL while it works (same ids): a long text
        # must not stop the caller's other threads (a server's event loop, the engine thread)
        return list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (one id or a sequence), cleaned up as transformers does."""
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text: str = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
                    .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
                    .replace(" 've", "'ve").replace(" 're", "'re"))
        return text

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False
                              ) -> str | list[str | None] | None:
        """The vocabulary strings of ``ids`` (transformers' ``convert_ids_to_tokens``)."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def get_chat_template(self, tools: list[Any] | None = None) -> str:
        """The template ``apply_chat_template`` renders (the "default" one of named templates,
        "tool_use" when tools are given and it exists); ValueError when there is none."""
        t = self.chat_template
        if isinstance(t, dict):
            if tools is not None and "tool_use" in t:
                return t["tool_use"]
            if "default" in t:
                return t["default"]
            raise ValueError(f"the tokenizer has several chat templates ({sorted(t)}) and none named 'default'")
        if t is None:
            raise ValueError("the tokenizer has no chat template")
        return t

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None,
                            continue_final_message: bool | str = False, chat_template: str | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """``conversation`` rendered with the chat template as transformers renders it (text, or
        its ids without added special tokens when ``tokenize``); ``template_kwargs`` reach the
        template, over the special tokens (bos_token, eos_token, ...). ``chat_template``
        (transformers'): another template, or the name of one of the tokenizer's named templates.

        ``continue_final_message`` (transformers' option): the text ends inside the last message,
        right after its content (or the field of that name), so that a reply continues it."""
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError("conversation must be a non-empty list of messages")
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not all(isinstance(v, dict) for v in value):
                raise TypeError(f"{name} must be a list of dicts (JSON schemas / documents)")
        messages = []
        for m in conversation:
            if not isinstance(m, Mapping):
                raise TypeError(f"chat messages must be dicts, got {m!r}")
            # as transformers: keys whose value is None are dropped; data is copied to plain types
            messages.append(_plain({k: v for k, v in m.items() if v is not None}))
        messages = _alias_reasoning(messages)
        if chat_template is None:
            source = self.get_chat_template(tools)
        elif isinstance(self.chat_template, dict) and chat_template in self.chat_template:
            source = self.chat_template[chat_template]
        else:
            source = chat_template
        template = _compile(source)
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be set: the "
                                 "first continues the last message, the second starts a new one")
            final = _mark_final_message(messages, source, continue_final_message)
        kwargs = _plain({**self.special_tokens_map, **template_kwargs})
        text: str = template.render(messages=messages, tools=_plain(tools), documents=_plain(documents),
                                    add_generation_prompt=add_generation_prompt, **kwargs)
        if continue_final_message:
            text = _cut_at_mark(text, final)
        return self.encode(text, add_special_tokens=False) if tokenize else text


#: appended to the message to continue, then found (its last occurrence) in the rendered text and
#: cut away with all after it; its trailing space shows whether the template kept the message's
#: trailing whitespace. transformers' own marker, so that a template that prints the messages twice
#: (e.g. as JSON after the turns) renders exactly as transformers renders it
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def _mark_final_message(messages: list[dict[str, Any]], template: str, field: bool | str) -> str:
    """Append ``_CONTINUE_MARK`` to the last message's ``field`` ("content" for True; every copy of
    a reasoning field), or to the last text part of a list content; the text it ends."""
    name = field if isinstance(field, str) else "content"
    last = messages[-1]
    final = last.get(name)
    if final is None:
        raise ValueError(f"continue_final_message is set but the final message has no {name!r} to continue")
    names = [name]
    if name in _REASONING_FIELDS:  # (copied under several names: mark each copy the template may read)
        names = [k for k in _REASONING_FIELDS if last.get(k) == final]
    if not any(k in template for k in names):
        raise ValueError(f"continue_final_message names {name!r}, which the chat template does not read")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = part["text"]
                part["text"] = text + _CONTINUE_MARK
                return str(text)
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    for k in names:
        last[k] = last[k] + _CONTINUE_MARK
    return str(final)


def _cut_at_mark(text: str, final: str) -> str:
    """The rendered ``text`` up to the final message's end (where ``_CONTINUE_MARK`` is)."""
    mark = _CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ValueError("continue_final_message is set but the chat template dropped part of the final "
                         "message, so there is nothing to continue")
    at = text.rindex(mark)
    if text[at:at + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing whitespace (and the mark's space)


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (transformers' ``_plain_template_data``): the
    sandboxed template sees no objects with methods of their own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)  # a numpy scalar
    if callable(item) and type(value).__module__ == "numpy":
        return _plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # a message's reasoning under any of its names also appears as reasoning_content and thinking
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


def check_chat_template(source: str, where: str) -> None:
    """A ValueError naming ``where`` when ``source`` is not a chat template this module can run
    (Jinja that does not compile in transformers' chat-template environment)."""
    from jinja2 import TemplateSyntaxError

    try:
        _compile(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not a valid Jinja template (line {exc.lineno}): {exc.message or exc}") from None


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """The template compiled in transformers' chat-template environment: sandboxed, trim_blocks
    and lstrip_blocks, loop controls, a no-op ``{% generation %}`` block, ``raise_exception``,
    ``strftime_now``, a JSON ``tojson`` that keeps non-ASCII, a restricted ``dict`` and ``namespace``."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        # older versions have known sandbox escapes, and chat templates are untrusted code
        raise ImportError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}: pip install -U jinja2")

    class Generation(jinja2.ext.Extension):
        # marks assistant text for transformers' assistant masks; rendering keeps the body as is
        tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # no underscore attributes: they would reach CPython internals
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)

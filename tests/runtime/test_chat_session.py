"""``deepinfer chat``'s conversation: the oldest turns are dropped to fit the context.

The trimming only formats conversations, so it runs on the default model's real tokenizer and
chat template (``LLM.apply_chat_template`` itself) without loading the weights.
"""

from __future__ import annotations

import pytest
from deepinfer.cli.chat_repl import ChatSession, Reply, _notice
from deepinfer.runtime.llm import LLM
from deepinfer.runtime.sampling_params import SamplingParams


class TemplateOnly:
    """The part of LLM the trimming uses: its chat template on the real tokenizer."""

    apply_chat_template = LLM.apply_chat_template

    def __init__(self, tokenizer) -> None:
        self.text_tokenizer = tokenizer
        self.model_path = "default"


def _n_tokens(model, messages) -> int:
    return len(model.apply_chat_template(messages)["prompt_token_ids"])


def _conversation(n_turns: int) -> list[dict[str, str]]:
    turns = []
    for i in range(n_turns):
        turns.append({"role": "user", "content": f"Question number {i}: tell me about the number {i}."})
        turns.append({"role": "assistant", "content": f"The number {i} is a number, followed by {i + 1}."})
    return turns


@pytest.mark.parametrize("max_tokens", [16, 64])
def test_oldest_turns_are_dropped_until_the_prompt_fits(tokenizer, max_tokens):
    model = TemplateOnly(tokenizer)
    system = {"role": "system", "content": "You are terse."}
    history = _conversation(6)
    new = {"role": "user", "content": "And the number 7?"}
    full = _n_tokens(model, [system, *history, new])
    context = full - 5 + max_tokens  # the whole history is 5 tokens too long
    session = ChatSession(model, SamplingParams(max_tokens=max_tokens), context_len=context, system="You are terse.")
    session.turns = list(history)
    budget = context - min(max_tokens, context // 2)

    # independent expectation: the longest suffix of whole (user, assistant) turns that fits
    expected_dropped = next(k for k in range(7) if _n_tokens(model, [system, *history[2 * k:], new]) <= budget)
    ids, dropped = session.add_user(new["content"])

    assert dropped == expected_dropped >= 1
    assert session.turns == [*history[2 * dropped:], new]
    assert session.messages()[0] == system  # the system prompt is never dropped
    assert len(ids) <= budget
    assert ids == model.apply_chat_template(session.messages())["prompt_token_ids"]


def test_a_message_that_alone_does_not_fit_is_refused_and_the_conversation_kept(tokenizer):
    model = TemplateOnly(tokenizer)
    session = ChatSession(model, SamplingParams(max_tokens=8), context_len=40)
    session.turns = _conversation(1)
    with pytest.raises(ValueError, match=r"the message is \d+ tokens .*\(context 40 tokens"):
        session.add_user("word " * 100)
    assert session.turns == _conversation(1)  # the conversation is left as it was


def test_reset_keeps_the_system_prompt(tokenizer):
    session = ChatSession(TemplateOnly(tokenizer), SamplingParams(), context_len=512, system="Be brief.")
    session.add_user("Hello")
    session.reset()
    assert session.messages() == [{"role": "system", "content": "Be brief."}]


@pytest.mark.parametrize("reply, expected", [
    (Reply("x", 3, "length", False), "[reply cut at --max-tokens 3; raise it for longer replies]"),
    (Reply("x", 2, "length", False), "[reply cut: the conversation filled the model's context; /reset starts over]"),
    (Reply("x", 1, "stop", True), "[reply stopped]"),
    (Reply("x", 2, "stop", False), None),
])
def test_notice_says_why_a_reply_ended_early(reply, expected):
    assert _notice(reply, max_tokens=3) == expected


def test_chat_refuses_a_model_without_a_chat_template(monkeypatch, capsys):
    """A base model (no template in its tokenizer) is refused before the first prompt, exit 2."""
    import argparse
    from types import SimpleNamespace

    from deepinfer.cli import commands

    base_model = SimpleNamespace(text_tokenizer=SimpleNamespace(chat_template=None), model_path="/models/base")
    monkeypatch.setattr(commands, "_llm", lambda args: base_model)
    parser = argparse.ArgumentParser(prog="deepinfer")
    commands.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["chat"])
    assert args.func(args) == 2
    assert capsys.readouterr().err == ("deepinfer chat: error: the model at '/models/base' has no chat "
                                      "template: use deepinfer generate\n")

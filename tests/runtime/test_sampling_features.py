"""allowed_token_ids, bad_words and priority end to end on the default model (vLLM's semantics)."""

from __future__ import annotations

import pytest
from deepinfer.runtime.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The capital of France is", "My favourite food is"]


@pytest.fixture(scope="module")
def llm(default_gguf):
    from deepinfer.runtime.llm import LLM

    return LLM(device="cpu", dtype="float32", max_model_len=256, cpu_kv_cache_bytes=64 << 20, max_num_seqs=4)


@pytest.fixture(scope="module")
def prio_llm(default_gguf):
    from deepinfer.runtime.llm import LLM

    return LLM(device="cpu", dtype="float32", max_model_len=128, cpu_kv_cache_bytes=32 << 20, max_num_seqs=1,
               scheduling_policy="priority")


def _ids(out):
    return list(out.outputs[0].token_ids)


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_allowed_token_ids_bound_every_sampled_token(llm):
    allowed = [11, 198, 253, 260, 281, 314, 327, 339, 355, 1183, 3120, 17020]
    outs = llm.generate(PROMPTS * 4, [SamplingParams(temperature=1.5, seed=s, max_tokens=12, ignore_eos=True,
                                                     allowed_token_ids=allowed) for s in range(12)], use_tqdm=False)
    seen = set()
    for o in outs:
        assert len(_ids(o)) == 12 and set(_ids(o)) <= set(allowed), _ids(o)
        seen |= set(_ids(o))
    assert len(seen) > 3  # sampled from the set, not stuck on one token
    # without the restriction the same seeds leave the set
    free = llm.generate(PROMPTS, SamplingParams(temperature=1.5, seed=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert any(not set(_ids(o)) <= set(allowed) for o in free)


def _forms(tok, word):
    """The token sequences vLLM bans for a word, from the tokenizer directly."""
    bare = tok.encode(word, add_special_tokens=False)
    spaced = tok.encode(" " + word, add_special_tokens=False)
    return [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


def test_bad_words_remove_a_word_greedy_decoding_would_write(llm):
    tok = llm.text_tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (base,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    ids = _ids(base)
    # a single-token word and a two-token phrase the greedy completion contains
    single = multi = None
    for i, t in enumerate(ids):
        text = tok.decode([t])
        if single is None and text.strip().isalpha() and len(text.strip()) > 2 and [t] in _forms(tok, text.strip()):
            single = text.strip()
        pair = tok.decode(ids[i:i + 2])
        if (multi is None and i + 1 < len(ids) and pair.strip().replace(" ", "").isalpha()
                and ids[i:i + 2] in _forms(tok, pair.strip())):
            multi = pair.strip()
    assert single and multi, tok.decode(ids)
    for word in (single, multi):
        forms = _forms(tok, word)
        assert any(_contains(ids, f) for f in forms)  # greedy decoding writes it
        (out,) = llm.generate(["The capital of France is"],
                              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word]),
                              use_tqdm=False)
        new = _ids(out)
        assert not any(_contains(new, f) for f in forms), (word, tok.decode(new))
        # up to the first token that would complete the word, the run is the greedy one
        first = min(i for f in forms for i in range(len(ids)) if ids[i:i + len(f)] == f) + len(forms[0]) - 1
        assert new[:first] == ids[:first] and new != ids


def test_bad_words_need_tokens(llm):
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate(["Hi"], SamplingParams(bad_words=["   "]), use_tqdm=False)


def test_priority_serves_smaller_first_and_keeps_prompt_order(prio_llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = ["one two", "three four five", "six"]
    outs = prio_llm.generate(prompts, params, use_tqdm=False, priority=[5, -2, 0])
    assert [o.prompt_token_ids for o in outs] == [prio_llm.text_tokenizer.encode(p) for p in prompts]
    # max_num_seqs=1: one request at a time, in priority order
    started = [o.metrics["first_scheduled_time"] for o in outs]
    assert started[1] < started[2] < started[0]
    same = prio_llm.generate(prompts, params, use_tqdm=False)  # default: all 0, arrival order
    assert [_ids(o) for o in same] == [_ids(o) for o in outs]
    chat = prio_llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]], params,
                         use_tqdm=False, priority=[1, 0])
    assert chat[1].metrics["first_scheduled_time"] < chat[0].metrics["first_scheduled_time"]


def test_priority_arguments_are_checked(llm, prio_llm):
    sp = SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        prio_llm.generate(["a", "b"], sp, use_tqdm=False, priority=[1])
    with pytest.raises(TypeError, match=r"priority\[0\] must be an int"):
        prio_llm.generate(["a"], sp, use_tqdm=False, priority=[True])
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(["a"], sp, use_tqdm=False, priority=[3])
    assert len(llm.generate(["a"], sp, use_tqdm=False, priority=[0])) == 1  # all 0: fine under fcfs (vLLM)
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', 'priority'\]"):
        from deepinfer.runtime.llm import LLM

        LLM(scheduling_policy="lifo")


def test_no_exponential_variate_is_zero():
    # u rounds to exactly 1 for one hash value in 2**24: its variate was 0, and a masked token
    # (probability 0) then won the race with 0 / 0 = NaN (found by the allowed_token_ids test)
    import torch
    from deepinfer.runtime.sampling.random_streams import exponential_noise

    noise = exponential_noise(torch.arange(2000, dtype=torch.int64), 49152)
    assert float(noise.min()) > 0
    assert int((noise < 3e-8).sum()) > 0  # the rounded case does occur in these streams

"""A server over an LLM with n-gram speculative decoding: completions equal the in-process
non-speculative ones (greedy), and /metrics counts the verified and accepted drafts."""

from __future__ import annotations

from conftest import API_KEY, MODEL_NAME, _llm, metrics, start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PROMPT = ("Repeat exactly: one two three four five six seven eight nine ten. "
          "one two three four five six seven eight nine ten. one two three")


def test_served_speculative_completions_equal_plain_and_metrics_count_drafts(reference_llm):
    import openai
    from deepinfer import SamplingParams

    want = reference_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    llm = _llm(max_num_seqs=4, speculative_config=SPEC)
    with start_server(llm, api_key=API_KEY) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        got = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
        assert got.choices[0].text == want
        m = metrics(s.url)
        assert m["deepinfer:spec_decode_num_draft_tokens_total"] > 0
        assert 0 < m["deepinfer:spec_decode_num_accepted_tokens_total"] <= \
            m["deepinfer:spec_decode_num_draft_tokens_total"]
        assert m["deepinfer:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0


def test_served_draft_model_completions_equal_plain(reference_llm):
    """The draft-model method served: the default model drafts for itself (its own KV cache in
    the same engine); the completion is the plain one and /metrics counts kept drafts."""
    import openai
    from deepinfer import SamplingParams
    from deepinfer.runtime.loading.default_model import default_model_path

    prompt = "The capital of France is Paris. The capital of Italy is"
    want = reference_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    llm = _llm(max_num_seqs=4, speculative_config={"model": default_model_path(), "num_speculative_tokens": 3})
    assert llm.engine.speculator.config.method == "draft_model"  # vLLM's inference from "model"
    with start_server(llm, api_key=API_KEY) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        m = metrics(s.url)
        assert m["deepinfer:spec_decode_num_accepted_tokens_total"] > 0

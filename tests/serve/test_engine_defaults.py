"""``deepinfer serve``'s own engine defaults (serve/engine_defaults.py): on CUDA the step budget
is 512 tokens, within the step graphs (at least the batch), an explicit budget or chunked
prefill turned off is left alone, and CPU servers keep ``LLM()``'s default."""

from __future__ import annotations

import pytest
import torch
from deepinfer.runtime.engine_args import EngineArgs
from deepinfer.runtime.worker import worker
from deepinfer.serve.engine_defaults import serve_llm_kwargs


@pytest.fixture
def on_cuda(monkeypatch):
    """The device resolves to CUDA (this machine has none): only the device's type is read."""
    seen = []

    def fake(device):
        seen.append(device)
        return torch.device("cuda"), None

    monkeypatch.setattr(worker, "runtime_device", fake)
    return seen


def test_cuda_budget_is_512_tokens(on_cuda):
    assert serve_llm_kwargs({"model": "m"})["max_num_batched_tokens"] == 512
    assert on_cuda == [None]  # resolved as LLM() resolves it: the selected backend's device


def test_cuda_budget_holds_a_full_decode_batch(on_cuda):
    assert serve_llm_kwargs({"max_num_seqs": 1024})["max_num_batched_tokens"] == 1024
    assert serve_llm_kwargs({"max_num_seqs": None})["max_num_batched_tokens"] == max(512, EngineArgs.max_num_seqs)


def test_cuda_budget_stays_within_the_step_graph_switch(on_cuda, monkeypatch):
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "256")
    assert serve_llm_kwargs({})["max_num_batched_tokens"] == 256
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "4096")  # larger graphs: the server's steps stay short
    assert serve_llm_kwargs({})["max_num_batched_tokens"] == 512
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "0")  # no step graphs: LLM()'s default
    assert serve_llm_kwargs({}) == {}


def test_explicit_budget_and_unchunked_prefill_are_left_alone(on_cuda):
    given = {"max_num_batched_tokens": 4096}
    assert serve_llm_kwargs(given) is given
    unchunked = {"enable_chunked_prefill": False}
    assert serve_llm_kwargs(unchunked) is unchunked
    assert on_cuda == []  # decided without resolving the device


def test_cpu_keeps_the_llm_default():
    kwargs = {"device": "cpu", "max_num_seqs": 64}
    assert serve_llm_kwargs(kwargs) == {"device": "cpu", "max_num_seqs": 64}


def test_bad_step_graph_switch_names_itself(on_cuda, monkeypatch):
    monkeypatch.setenv("DEEPINFER_STEP_GRAPH_TOKENS", "many")
    with pytest.raises(ValueError, match="DEEPINFER_STEP_GRAPH_TOKENS"):
        serve_llm_kwargs({})

"""The one step executor: the synchronous and the overlap loop launch every step through it.

A fake model runner whose next token is a known function of the current one (the independent
expectation) checks the executor's choices — eager forward or graph replay, argmax or sampler,
inputs built from the host or gathered on the device from the previous step (ZOS) — and the
default model checks that both loops give the same tokens through it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling_params import SamplingParams
from engine_helpers import run_all

pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")

VOCAB = 97


def successor(token: int) -> int:
    """The fake model's greedy next token."""
    return (token * 7 + 3) % VOCAB


def fake_logits(ids: torch.Tensor) -> torch.Tensor:
    """Logits whose argmax is ``successor`` of each id; the runner-up is close enough that sampling
    at temperature 1 sometimes picks it (so sampled runs differ from greedy ones)."""
    ids = ids.to(torch.int64).flatten()
    logits = torch.zeros(len(ids), VOCAB, dtype=torch.float32)
    rows = torch.arange(len(ids))
    logits[rows, (ids * 7 + 3) % VOCAB] = 4.0
    logits[rows, (ids + 1) % VOCAB] = 3.5
    return logits


class FakeRunner:
    """A model runner on the CPU: ``execute`` and graph replays give ``fake_logits`` of the step's ids."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.graphs: FakeGraphs | None = None
        self.executed = 0
        self.tensor_ids = 0  # eager steps whose ids came as a device tensor (gathered: ZOS)

    def execute(self, *, input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                logits_indices):
        self.executed += 1
        if isinstance(input_ids, torch.Tensor):
            self.tensor_ids += 1
            ids = input_ids
        else:
            ids = torch.from_numpy(np.asarray(input_ids).astype(np.int64))
        rows = torch.from_numpy(np.asarray(logits_indices).astype(np.int64))
        return fake_logits(ids[rows])

    def copy_blocks(self, src, dst) -> None:
        pass

    def restore_torch_threads(self) -> None:
        pass


class FakeGraphs:
    """Decode 'graphs' for every batch size: replay reads the ids from the host buffer it is given,
    after ``before_replay`` ran on a copy of it (as the CUDA graph runner's device twin)."""

    def __init__(self, layout) -> None:
        self.layout = layout  # a StepBuffers of the executor's layout
        self.replays = 0

    def can_replay(self, args) -> bool:
        rows = int(args.num_rows)
        return int(args.num_tokens) == rows and int(args.num_logits) == rows and rows > 0

    def replay(self, rows, host=None, before_replay=None):
        self.replays += 1
        twin = (self.layout.host if host is None else host).clone()
        views = self.layout.device_views(twin)
        if before_replay is not None:
            before_replay(views, rows)
        logits = fake_logits(views["input_ids"][:rows])
        return logits, logits.argmax(dim=-1)


class TinyTokenizer:
    """Enough of a tokenizer for the loop's text: one character per id."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + int(i)) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(0x100 + int(i)) for i in ids]


def make_fake_loop(*, graphs: bool = False, overlap: bool = False):
    from deepinfer.runtime.engine.loop import EngineConfig, EngineLoop

    runner = FakeRunner()
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                       max_model_len=256, vocab_size=VOCAB, eos_token_id=-1,
                       graph_batch_sizes=[1, 2, 4, 8] if graphs else None)
    loop = EngineLoop(runner, TinyTokenizer(), cfg, overlap_scheduling=overlap)
    if graphs:
        runner.graphs = FakeGraphs(loop.executor.buffers[0])
    return loop, runner


def chain(first: int, n: int) -> list[int]:
    out, t = [], first
    for _ in range(n):
        t = successor(t)
        out.append(t)
    return out


def penalized_chain(prompt: list[int], n: int, penalty: float) -> list[int]:
    """Greedy tokens of the fake model under a repetition penalty (vLLM's: positive logits of
    tokens seen in the prompt or output divided by ``penalty``), computed by hand."""
    seen, out, t = set(prompt), [], prompt[-1]
    for _ in range(n):
        logits = fake_logits(torch.tensor([t]))[0]
        for s in seen:
            logits[s] = logits[s] / penalty if logits[s] > 0 else logits[s] * penalty
        t = int(torch.argmax(logits))
        out.append(t)
        seen.add(t)
    return out


PROMPTS = [[5, 9, 11], [40, 2], [60, 61, 62, 63, 64], [13]]


def _tokens(outs):
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_greedy_tokens_follow_the_model_whatever_the_path(graphs, overlap):
    loop, runner = make_fake_loop(graphs=graphs, overlap=overlap)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, steps = run_all(loop, PROMPTS, params)
    assert _tokens(outs) == [[chain(p[-1], 12)] for p in PROMPTS]
    assert loop.executor.num_launched >= steps - 1  # every step was launched by the executor
    if graphs:  # decode steps replayed; only prefills ran eagerly
        assert runner.graphs.replays > 0 and runner.executed <= 2
    else:
        assert runner.executed == loop.executor.num_launched
    if overlap:
        assert loop.overlap.num_ahead > 0
        if not graphs:  # steps run ahead took their ids from the previous step's tokens on the device
            assert runner.tensor_ids == loop.overlap.num_ahead
    else:
        assert runner.tensor_ids == 0


def test_sync_and_overlap_sample_the_same_tokens_through_the_one_executor(monkeypatch):
    from deepinfer.runtime.engine import executor as engine_executor

    calls = []
    real = engine_executor.sample
    monkeypatch.setattr(engine_executor, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, n=2),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)]
    got = {}
    for graphs in (False, True):
        for overlap in (False, True):
            loop, _ = make_fake_loop(graphs=graphs, overlap=overlap)
            got[graphs, overlap] = _tokens(run_all(loop, PROMPTS, params)[0])
            if overlap:
                assert loop.overlap.num_ahead > 0
    assert calls  # sampled and penalized rows went through the sampler
    first = got[False, False]
    assert all(v == first for v in got.values())
    # the sampler really sampled: the seeded request left the greedy chain somewhere
    assert first[0][0] != chain(PROMPTS[0][-1], 16)
    assert first[1][0] == penalized_chain(PROMPTS[1], 16, 1.5)
    assert first[3][0] == chain(PROMPTS[3][-1], 16)


def test_a_request_with_logprobs_keeps_the_overlap_loop_synchronous():
    loop, _ = make_fake_loop(overlap=True)
    outs, _ = run_all(loop, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))
    assert loop.overlap.num_ahead == 0
    assert _tokens(outs) == [[chain(p[-1], 8)] for p in PROMPTS[:2]]
    for o in outs:
        lps = o.outputs[0].logprobs
        assert len(lps) == 8 and all(len(d) >= 1 for d in lps)


def test_default_model_sync_and_overlap_give_the_same_tokens(loaded_default, tokenizer):
    from deepinfer.runtime.engine.loop import EngineConfig, EngineLoop
    from deepinfer.runtime.worker.model_runner import ModelRunner

    prompts = [tokenizer(t).input_ids for t in ("The capital of France is", "def fib(n):", "1, 2, 3,")]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=1, top_k=40, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, presence_penalty=1.0)]
    got = {}
    for overlap in (False, True):
        runner = ModelRunner(loaded_default, num_blocks=64, block_size=16, device=torch.device("cpu"),
                             dtype=torch.float32)
        cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256,
                           max_model_len=256, vocab_size=loaded_default.config.vocab_size,
                           eos_token_id=loaded_default.config.eos_token_ids[0])
        loop = EngineLoop(runner, tokenizer, cfg, overlap_scheduling=overlap)
        got[overlap] = _tokens(run_all(loop, prompts, params)[0])
        if overlap:
            assert loop.overlap.num_ahead > 0
    assert got[True] == got[False]


def test_a_fresh_engine_loop_writes_into_the_buffers_the_graphs_replay():
    # A server gives a stuck LLM a fresh engine loop over the same runner (serve's
    # rebuild_if_stuck): its steps must be written where the captured graphs read them (the
    # worker's step buffers), not into new ones, and it keeps the loop's settings.
    loop, runner = make_fake_loop(graphs=True)
    loop.retry_failed_steps = True
    fresh = loop.fresh()
    assert fresh is not loop and fresh.step_buffers is loop.step_buffers
    assert fresh.executor.buffers[0] is loop.step_buffers and fresh.retry_failed_steps
    assert fresh.cfg is loop.cfg and not fresh.requests
    outs, _ = run_all(fresh, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert _tokens(outs) == [[chain(p[-1], 6)] for p in PROMPTS[:2]] and runner.graphs.replays > 0

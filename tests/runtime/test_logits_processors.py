"""Custom logits processors with vLLM's v1 interface (issue 26): ``LLM(logits_processors=[...])``.

As vLLM's tests (tests/v1/logits_processors): a processor that forces a per-request target token
(``extra_args``) makes those requests emit only it and leaves the others exactly as without the
processor; the batch bookkeeping a processor sees is consistent (every row has a request, output
token lists grow by the applied tokens and end equal to the outputs); ``validate_params`` refuses
a request; classes may be given by name; bad names fail when the engine is built.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from deepinfer.runtime.sampling.logits_processors import BatchUpdate, LogitsProcessor

TARGET = 42


class TargetTokenProcessor(LogitsProcessor):
    """Forces ``extra_args["target_token"]`` where a request has it (vLLM's dummy processor)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.targets: dict[int, int] = {}
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs

    @classmethod
    def validate_params(cls, sampling_params):
        t = (sampling_params.extra_args or {}).get("target_token")
        if t is not None and not isinstance(t, int):
            raise ValueError(f"target_token must be an int, got {t!r}")

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.targets.pop(i, None)
        for i, params, _, _ in batch_update.added:
            t = (params.extra_args or {}).get("target_token") if params is not None else None
            if t is None:
                self.targets.pop(i, None)
            else:
                self.targets[i] = t

    def apply(self, logits):
        for i, t in self.targets.items():
            keep = logits[i, t].item()
            logits[i].fill_(float("-inf"))
            logits[i, t] = keep
        return logits


class RecordingProcessor(LogitsProcessor):
    """Keeps the batch as the updates describe it and checks it against each apply."""

    instances: ClassVar[list[RecordingProcessor]] = []

    def __init__(self, vllm_config, device, is_pin_memory):
        self.batch: dict[int, tuple[object, list[int], list[int]]] = {}
        self.size = 0
        self.steps = 0
        self.lists: list[list[int]] = []
        RecordingProcessor.instances.append(self)

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        if batch_update is not None:
            for i in batch_update.removed:
                self.batch.pop(i, None)
            for i, params, prompt, out in batch_update.added:
                self.batch[i] = (params, prompt, out)
                self.lists.append(out)
            assert not batch_update.moved
            self.size = batch_update.batch_size

    def apply(self, logits):
        self.steps += 1
        assert logits.shape[0] == self.size == len(self.batch) and sorted(self.batch) == list(range(self.size))
        return logits


@pytest.fixture(scope="module")
def llms():
    from deepinfer import LLM

    kw = dict(max_model_len=256, cpu_kv_cache_bytes=16 << 20, num_threads=1)
    return LLM(**kw), LLM(logits_processors=[TargetTokenProcessor, RecordingProcessor], **kw)


def test_a_target_token_processor_forces_its_requests_and_leaves_the_others(llms):
    from deepinfer import SamplingParams

    plain, procs = llms
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]
    lengths = [5, 9, 3, 7]  # requests leave the batch at different steps
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                          extra_args={"target_token": TARGET} if i % 2 == 0 else None)
           for i, m in enumerate(lengths)]
    outs = procs.generate(prompts, sps, use_tqdm=False)
    ref = plain.generate(prompts, sps, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        ids = list(o.outputs[0].token_ids)
        if i % 2 == 0:
            assert ids == [TARGET] * lengths[i]
        else:
            assert ids == list(r.outputs[0].token_ids)
    # seeded sampling: the untargeted requests draw as without processors
    sps = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=6,
                          extra_args={"target_token": TARGET} if i == 0 else None) for i in range(3)]
    outs = procs.generate(prompts[:3], sps, use_tqdm=False)
    ref = plain.generate(prompts[:3], sps, use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == [TARGET] * 6
    assert [list(o.outputs[0].token_ids) for o in outs[1:]] == [list(r.outputs[0].token_ids) for r in ref[1:]]


def test_the_batch_a_processor_sees_is_consistent_and_output_lists_are_live(llms):
    from deepinfer import SamplingParams

    _, procs = llms
    rec = RecordingProcessor.instances[-1]
    before = len(rec.lists)
    outs = procs.generate(["a b c", "d e f g", "h"], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                                      for m in (4, 6, 2)], use_tqdm=False)
    lists = rec.lists[before:]
    finals = sorted(list(o.outputs[0].token_ids) for o in outs)
    # each sample's list (the same object every time it was added) ends as its output
    assert sorted({id(x): x for x in lists}.values()) == finals


def test_validate_params_refuses_a_request_and_names_resolve(llms):
    from deepinfer import LLM, SamplingParams

    _, procs = llms
    with pytest.raises(ValueError, match="target_token must be an int"):
        procs.generate(["Hi"], SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot import"):
        LLM(logits_processors=["no_such_module_xyz:Proc"], max_model_len=64, cpu_kv_cache_bytes=4 << 20)
    with pytest.raises(TypeError, match="lacks"):
        LLM(logits_processors=[int], max_model_len=64, cpu_kv_cache_bytes=4 << 20)
    with pytest.raises(ValueError, match="speculative decoding"):  # verify steps would skip the processors
        LLM(logits_processors=[TargetTokenProcessor], speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            max_model_len=64, cpu_kv_cache_bytes=4 << 20)
    named = LLM(logits_processors=[f"{__name__}:TargetTokenProcessor"], max_model_len=64,
                cpu_kv_cache_bytes=4 << 20, num_threads=1)
    out = named.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                extra_args={"target_token": TARGET}), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == [TARGET] * 3


class RaisingProcessor(LogitsProcessor):
    """Raises in ``apply`` for a request whose extra_args ask it to."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.armed = False

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        if batch_update is not None:
            self.armed = any((p.extra_args or {}).get("boom") for _, p, _, _ in batch_update.added if p is not None)

    def apply(self, logits):
        if self.armed:
            raise RuntimeError("processor failed on purpose")
        return logits


def test_a_failing_processor_fails_its_step_and_the_engine_goes_on():
    """Containment: a processor that raises fails the step it ran in, as a failed forward does
    (the caller gets the error, nothing hangs); the next requests run."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(logits_processors=[RaisingProcessor], max_model_len=64, cpu_kv_cache_bytes=4 << 20, num_threads=1)
    with pytest.raises(RuntimeError, match="processor failed on purpose"):
        llm.generate(["Hi"], SamplingParams(max_tokens=3, extra_args={"boom": True}), use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.cfg.num_blocks

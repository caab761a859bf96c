"""The native CPU decode path in the runtime (models/native_decode.py): used for decode-only steps
on CPU with a float32 KV cache, the same results as the torch path within float32 summation
order, and switched off by ``DEEPINFER_CPU_NATIVE=0``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer.runtime.loading.model_loader import load_model
from deepinfer.runtime.worker.model_runner import ModelRunner
from tiny_models import save_tiny_model

pytest.importorskip("deepinfer_engine._cpu_kernels", reason="engine built without _cpu_kernels")
CPU = torch.device("cpu")
BS = 4


def runner_for(path, native: bool, monkeypatch, **kw) -> ModelRunner:
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "1" if native else "0")
    loaded = load_model(str(path), device=CPU, dtype=torch.float32, max_positions=128, **kw)
    runner = ModelRunner(loaded, num_blocks=32, block_size=BS, device=CPU, dtype=torch.float32)
    assert (runner.native_decode is not None) == native
    return runner


def run_batch(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill all prompts in one step, then ``steps`` batched decode steps with greedy tokens;
    returns each step's logits. Sequence i owns blocks 8i.. (not contiguous with its neighbours)."""
    tables = np.array([[8 * i + j for j in range(8)] for i in range(len(prompts))], dtype=np.int32)
    seqs = [list(p) for p in prompts]
    out, starts = [], [0] * len(seqs)
    for _ in range(steps + 1):
        ids, pos, qsl = [], [], [0]
        for i, s in enumerate(seqs):
            ids += s[starts[i]:]
            pos += list(range(starts[i], len(s)))
            qsl.append(len(ids))
        pos_a = np.array(pos)
        seq_of = np.repeat(np.arange(len(seqs)), np.diff(qsl))
        slots = tables[seq_of, pos_a // BS] * BS + pos_a % BS
        logits = runner.execute(input_ids=np.array(ids), positions=pos_a, slot_mapping=slots,
                                query_start_loc=np.array(qsl), seq_lens=np.array([len(s) for s in seqs]),
                                block_tables=tables, logits_indices=np.array(qsl[1:]) - 1)
        out.append(logits)
        for i, s in enumerate(seqs):
            starts[i] = len(s)
            s.append(int(logits[i].argmax()))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_native_decode_matches_the_torch_path(tmp_path, monkeypatch, arch):
    save_tiny_model(tmp_path, arch)
    prompts = [[5, 9, 13], [7] * 9, [100, 3, 200, 4, 11, 250]]
    native = run_batch(runner_for(tmp_path, True, monkeypatch), prompts, 6)
    torch_path = run_batch(runner_for(tmp_path, False, monkeypatch), prompts, 6)
    for step, (a, b) in enumerate(zip(native, torch_path, strict=True)):
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {step}: greedy tokens differ"
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_native_path_is_used_for_decode_steps_only(tmp_path, monkeypatch):
    save_tiny_model(tmp_path)
    runner = runner_for(tmp_path, True, monkeypatch)
    assert runner.native_decode is not None and runner.native_decode.kind == "float32"
    calls = []
    native = runner.native_decode

    def counting(*args):
        calls.append(len(args[0]))
        return native(*args)

    runner.native_decode = counting  # type: ignore[assignment]
    run_batch(runner, [[5, 9, 13], [7, 8]], 3)
    assert calls == [2, 2, 2]  # the prefill step ran on torch, the three decode steps natively


def test_bfloat16_and_switched_off_runners_use_torch(tmp_path, monkeypatch):
    save_tiny_model(tmp_path)
    assert runner_for(tmp_path, False, monkeypatch).native_decode is None
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "1")
    loaded = load_model(str(tmp_path), device=CPU, dtype=torch.bfloat16, max_positions=128)
    assert ModelRunner(loaded, num_blocks=8, block_size=BS, device=CPU, dtype=torch.bfloat16).native_decode is None


def test_default_gguf_decodes_natively_on_its_quantized_blocks(default_gguf, monkeypatch):
    runner = runner_for(default_gguf, True, monkeypatch, keep_quantized=True)
    assert runner.native_decode is not None and runner.native_decode.kind == "quantized"


def test_models_the_kernels_do_not_run_stay_on_torch(tmp_path, monkeypatch):
    """Qwen3's per-head q/k norms are not in the native kernels: its decode steps stay on torch
    (running them natively would silently skip the norms)."""
    save_tiny_model(tmp_path, "qwen3")
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "1")
    loaded = load_model(str(tmp_path), device=CPU, dtype=torch.float32, max_positions=128)
    runner = ModelRunner(loaded, num_blocks=32, block_size=BS, device=CPU, dtype=torch.float32)
    assert runner.native_decode is None


def test_torch_runs_on_one_thread_while_steps_are_native(tmp_path, monkeypatch):
    """torch's OpenMP workers spin after each parallel region, on the cores the native pool needs:
    torch runs on one thread from a native step on, gets its own count back for its forward passes
    (prefill) and when the engine has no work left."""
    import deepinfer.runtime.engine.executor as engine_executor
    from deepinfer import LLM, SamplingParams
    from tiny_models import save_tiny_tokenizer

    save_tiny_model(tmp_path)
    save_tiny_tokenizer(tmp_path)
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, enable_prefix_caching=False)
        runner = llm.runner
        assert runner.native_decode is not None
        seen: list[tuple[str, int]] = []
        native, forward, sample = runner.native_decode, runner.model.forward, engine_executor.sample

        def spy(kind, fn):
            def call(*args, **kwargs):
                seen.append((kind, torch.get_num_threads()))
                return fn(*args, **kwargs)
            return call

        monkeypatch.setattr(runner, "native_decode", spy("native", native))
        monkeypatch.setattr(runner.model, "forward", spy("torch", forward))
        monkeypatch.setattr(engine_executor, "sample", spy("sample", sample))
        # sampled, not greedy: greedy steps take the argmax without calling sample()
        params = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 9, 13]}, {"prompt_token_ids": [7, 8]}], params, use_tqdm=False)
        assert torch.get_num_threads() == 2, "the engine ran out of work: torch must have its threads back"
        llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], params, use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    # per generate: one prefill on torch (2 threads) and its sampling, then 3 native decode steps
    # whose sampling also runs on one thread
    one_call = [("torch", 2), ("sample", 2)] + [("native", 1), ("sample", 1)] * 3
    assert seen == one_call * 2

"""Tensor parallelism on CPU over gloo: TP=2 (two processes) against TP=1 on tiny random models.

Expectations are independent of the sharding code: TP=1 is the single-process model (checked
against transformers in test_loaders), the slices are read back from the safetensors file, and
the divisibility errors are the arithmetic of the model's shape.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
from deepinfer.runtime.sampling_params import SamplingParams
from tiny_models import save_tiny_model, save_tiny_tokenizer

pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch was built without torch.distributed / gloo", allow_module_level=True)

# float32; the all-reduce sums the two ranks' partial products in another order than one matmul
LOGITS_TOL = dict(atol=1e-5, rtol=1e-5)
PROMPTS = [[5, 17, 33, 2, 99, 140, 7], [7, 8, 250, 3, 11, 12, 13, 14, 15, 16, 17, 18, 19], [300, 4]]
LLM_ARGS = dict(num_kv_blocks=96, block_size=4, max_model_len=128, max_num_batched_tokens=16,
                enable_prefix_caching=False)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from deepinfer import LLM

    one = LLM(tiny_model_dir, **LLM_ARGS)
    # gloo usually sees a dead peer at once, but on a busy machine a collective to it can wait
    # for the timeout: a short one bounds the killed-rank test whichever way the error comes
    saved = os.environ.get("DEEPINFER_TP_TIMEOUT_S")
    os.environ["DEEPINFER_TP_TIMEOUT_S"] = "30"
    try:
        two = LLM(tiny_model_dir, tensor_parallel_size=2, **LLM_ARGS)
    finally:
        if saved is None:
            del os.environ["DEEPINFER_TP_TIMEOUT_S"]
        else:
            os.environ["DEEPINFER_TP_TIMEOUT_S"] = saved
    yield one, two
    two.close()


def _prefill_logits(llm, prompt):
    """Logits of every prompt row through the LLM's runner (rank 0 of TP=2 broadcasts the step)."""
    n = len(prompt)
    blocks = -(-n // 4)
    return llm.runner.execute(
        input_ids=np.array(prompt), positions=np.arange(n), slot_mapping=np.arange(n) + 4,
        query_start_loc=np.array([0, n]), seq_lens=np.array([n]),
        block_tables=np.arange(1, blocks + 1)[None], logits_indices=np.arange(n))


def test_logits_equal_tp1(pair):
    one, two = pair
    for prompt in PROMPTS:
        a, b = _prefill_logits(one, prompt), _prefill_logits(two, prompt)
        assert a.shape == b.shape == (len(prompt), 320)
        torch.testing.assert_close(b, a, **LOGITS_TOL)


def test_greedy_outputs_equal_tp1(pair):
    # chunked prefill (16-token budget) mixes prefill chunks and decodes in one step
    one, two = pair
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in one.generate(PROMPTS, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in two.generate(PROMPTS, sp, use_tqdm=False)]
    assert b == a
    assert all(len(t) == 24 for t in a)


def test_seeded_parallel_samples_equal_tp1(pair):
    # n=2 forks share the prompt's blocks; the partial last block is copied on every rank
    one, two = pair
    sp = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    a = one.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    b = two.generate(PROMPTS[:1], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
    np.testing.assert_allclose([c.cumulative_logprob for c in b.outputs],
                               [c.cumulative_logprob for c in a.outputs], rtol=1e-4)


def test_fused_decode_forward_split_two_ways_gives_the_unsplit_logits(tmp_path):
    """The decode forward CUDA graphs capture (fused Triton kernels, run here in Triton's CPU
    interpreter) calls the row-parallel and vocabulary-parallel layers, so it runs split too."""
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    save_tiny_model(tmp_path, "llama")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "tp_fused_check.py"),
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_sharded_loading_reads_only_each_ranks_slices(tmp_path, monkeypatch):
    import safetensors
    from deepinfer.runtime.loading.model_loader import load_model
    from deepinfer.runtime.parallel.process_group import TensorParallelGroup

    save_tiny_model(tmp_path, "llama")
    full = {}
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as st:
        for name in st.keys():
            full[name] = st.get_tensor(name)
    reads: list[tuple[str, object]] = []
    real_open = safetensors.safe_open

    class Slice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            reads.append((self.name, index))
            return self.inner[index]

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            reads.append((name, "whole"))
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            return Slice(name, self.inner.get_slice(name))

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    cpu = torch.device("cpu")
    for rank in (0, 1):
        reads.clear()
        group = TensorParallelGroup(rank=rank, world_size=2, device=cpu)
        loaded = load_model(str(tmp_path), device=cpu, dtype=torch.float32, tensor_parallel=group)
        whole = {n for n, i in reads if i == "whole"}
        assert whole and all("norm" in n for n in whole), whole  # only the replicated norms are read whole
        elements = 0
        for name, index in reads:
            if index == "whole":
                elements += full[name].numel()
                continue
            dim = 0 if isinstance(index, slice) else 1
            s = index if dim == 0 else index[1]
            size = full[name].shape[dim]
            assert (s.start, s.stop) == (rank * size // 2, (rank + 1) * size // 2), (name, index)
            elements += full[name].numel() // 2
        norms = sum(t.numel() for n, t in full.items() if "norm" in n)
        assert elements == (sum(t.numel() for t in full.values()) - norms) // 2 + norms
        # the rank's parameters are its slices of the file's tensors
        m = loaded.model
        q, k, v = (full[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
        half = lambda t, dim=0, r=rank: t.chunk(2, dim)[r]  # noqa: E731
        assert torch.equal(m.layers[1].qkv_proj.weight, torch.cat([half(q), half(k), half(v)]))
        assert torch.equal(m.layers[1].o_proj.weight, half(full["model.layers.1.self_attn.o_proj.weight"], 1))
        assert torch.equal(m.layers[0].down_proj.weight, half(full["model.layers.0.mlp.down_proj.weight"], 1))
        assert torch.equal(m.embed_tokens.weight, half(full["model.embed_tokens.weight"]))
        assert torch.equal(m.lm_head.weight, half(full["lm_head.weight"]))
        assert loaded.config.num_key_value_heads == 1  # the KV cache is sized for the rank's heads


def test_gguf_shards_are_slices_of_the_dense_tensors(default_gguf):
    """SmolLM2 (9 q heads, 3 kv heads) split 3 ways: each rank's rows/columns, read from the
    quantized blocks, equal the same slice of the whole dequantized tensor (the Q/K rotary
    un-permutation included)."""
    from deepinfer.runtime.loading.gguf_loader import GGUFModel
    from deepinfer.runtime.loading.sharded_loading import gguf_shard

    model = GGUFModel(default_gguf)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"]
    for name in names:
        dense = model.dense(name)
        dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
        for rank in range(3):
            expected = dense if "norm" in name else dense.chunk(3, dim)[rank]
            assert torch.equal(gguf_shard(model, name, rank, 3), expected), (name, rank)


def test_one_tensor_parallel_llm_per_process(pair, tiny_model_dir):
    from deepinfer import LLM

    with pytest.raises(RuntimeError, match="process group is already active"):
        LLM(tiny_model_dir, tensor_parallel_size=2, **LLM_ARGS)


def test_a_killed_rank_ends_the_llm_with_an_error_naming_it(pair):
    # last of the tests on ``pair``: its TP=2 LLM is dead afterwards
    from deepinfer.runtime.distributed.launcher import TensorParallelError

    llm = pair[1]
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    stream = llm.stream(PROMPTS[0], sp)
    next(stream)
    workers = llm.runner.workers
    (worker,) = workers.procs.values()
    os.kill(worker.pid, signal.SIGKILL)
    assert workers.dead_event.wait(10), "the watchdog did not notice the dead rank"
    # Forget it (as if the rank died inside the step): the step's broadcast / all-reduce to the
    # dead rank must fail by itself and the error still name the rank.
    workers.dead_event.clear()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 60  # the 30 s collective timeout at the latest
    # the LLM stays failed, at once, with the same error
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        llm.generate([PROMPTS[1]], sp, use_tqdm=False)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(("n", "field", "value"), [(3, "num_attention_heads", 4), (4, "num_key_value_heads", 2)])
def test_a_shape_that_does_not_split_is_a_value_error(tmp_path, n, field, value):
    from deepinfer import LLM

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n} does not divide the model's {field}={value}"):
        LLM(str(tmp_path), tensor_parallel_size=n, **LLM_ARGS)


@pytest.mark.parametrize(("field", "value"), [("intermediate_size", 90), ("vocab_size", 321)])
def test_intermediate_and_vocab_must_divide(field, value):
    from deepinfer.runtime.models.config import ModelConfig
    from deepinfer.runtime.parallel.process_group import check_divisible

    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16)
    shape[field] = value
    check_divisible(ModelConfig(**{**shape, field: 96 if field == "intermediate_size" else 320}), 4)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=4 does not divide the model's {field}={value}"):
        check_divisible(ModelConfig(**shape), 4)


def test_more_ranks_than_cuda_devices_is_a_value_error():
    from deepinfer.runtime.parallel.process_group import check_devices

    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={count + 1} .* {count} are present"):
        check_devices(count + 1, torch.device("cuda"))
    assert check_devices(5, torch.device("cpu")) == [torch.device("cpu")] * 5  # CPU: any N


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), ("2", TypeError), (2.0, TypeError)])
def test_bad_tensor_parallel_size(tmp_path, value, error):
    from deepinfer import LLM

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    with pytest.raises(error, match="tensor_parallel_size"):
        LLM(str(tmp_path), tensor_parallel_size=value, **LLM_ARGS)


def test_overlap_scheduling_is_refused_with_tensor_parallelism(tmp_path):
    from deepinfer import LLM

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="overlap_scheduling=True does not run with tensor_parallel_size=2"):
        LLM(str(tmp_path), tensor_parallel_size=2, overlap_scheduling=True, **LLM_ARGS)


def test_torchrun_world_size_must_match(tmp_path, monkeypatch):
    from deepinfer import LLM

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    for key, val in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, val)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 differs from torchrun's WORLD_SIZE=4"):
        LLM(str(tmp_path), tensor_parallel_size=2, **LLM_ARGS)


def test_generate_command_with_two_ranks_prints_what_one_rank_prints(tmp_path):
    """``deepinfer generate --tensor-parallel-size 2`` as a user runs it: the spawned rank
    starts under ``python -m deepinfer``, the completion equals TP=1's, and the process exits."""
    import subprocess
    import sys

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    outs = []
    for n in ("1", "2"):
        out = subprocess.run([sys.executable, "-m", "deepinfer", "generate", "--model", str(tmp_path),
                              "--tensor-parallel-size", n, "--max-tokens", "8", "--ignore-eos", "--no-stream",
                              "t5 t17 t33 t99"], capture_output=True, text=True, env=env, timeout=240)
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout)
    assert outs[1] == outs[0]
    assert len(outs[0].split()) == 8  # eight generated word-level tokens


def test_env_report_says_what_tensor_parallelism_can_use():
    from deepinfer.plugins.env_report import collect, render

    report = collect()
    tp = report["tensor_parallel"]
    assert tp["gloo"] is torch.distributed.is_gloo_available()
    assert tp["cuda_devices"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    text = render(report)
    assert "Tensor parallelism: CPU over gloo: yes; CUDA over NCCL: " in text
    assert "DEEPINFER_TP_TIMEOUT_S=" in text


# ---- ranks are started as a module, never by importing the user's __main__ ----------------------
SCRIPT = """\
import os, sys
from deepinfer import LLM, SamplingParams
print("BODY RAN", os.getpid(), flush=True)  # no main guard: must run once, in this process only
llm = LLM({path!r}, tensor_parallel_size=2, **{args!r})
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", [list(o.outputs[0].token_ids) for o in outs], flush=True)
"""


@pytest.fixture(scope="module")
def script_model(tmp_path_factory):
    """A tiny Llama, its TP=1 greedy tokens, and the script that runs it with two ranks (no
    ``if __name__ == "__main__":`` guard, no ``close()``: the ranks stop when it exits)."""
    from deepinfer import LLM

    path = tmp_path_factory.mktemp("script_model")
    save_tiny_model(path, "llama")
    save_tiny_tokenizer(path)
    with LLM(str(path), **LLM_ARGS) as one:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        want = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, sp, use_tqdm=False)]
    return path, want, SCRIPT.format(path=str(path), args=LLM_ARGS, prompts=PROMPTS)


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("how", ["script file", "stdin", "-c"])
def test_two_ranks_from_a_script_without_main_guard_stdin_and_dash_c(script_model, tmp_path, how):
    import subprocess

    _, want, script = script_model
    cmd, stdin = [sys.executable, "-c", script], None
    if how == "script file":
        (tmp_path / "no_guard.py").write_text(script)
        cmd = [sys.executable, str(tmp_path / "no_guard.py")]
    elif how == "stdin":
        cmd, stdin = [sys.executable, "-"], script
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=_env(), timeout=240,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    body = [line for line in out.stdout.splitlines() if line.startswith("BODY RAN")]
    assert len(body) == 1, out.stdout  # the script's body ran once (rank 1 did not import it)
    (tokens,) = [line for line in out.stdout.splitlines() if line.startswith("TOKENS ")]
    assert json.loads(tokens[len("TOKENS "):]) == want
    assert "Traceback" not in out.stderr and "gone away" not in out.stderr, out.stderr


def test_ranks_end_when_rank_0_is_killed(script_model, tmp_path):
    """Rank 0 killed (no atexit, no close): rank 1 sees its stdin end and exits instead of
    waiting for the next step for ever."""
    import subprocess

    path, _, _ = script_model
    script = (f"import sys, time\nfrom deepinfer import LLM\n"
              f"llm = LLM({str(path)!r}, tensor_parallel_size=2, **{LLM_ARGS!r})\n"
              "print('RANK1', llm.runner.workers.procs[1].pid, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=_env())
    try:
        line = proc.stdout.readline()
        assert line.startswith("RANK1 "), line
        rank1 = int(line.split()[1])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while _alive(rank1) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank1), "rank 1 outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _alive(pid: int) -> bool:
    """The process runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

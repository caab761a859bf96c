"""Decode steps replayed from CUDA graphs give the eager path's greedy tokens (float32, TF32 off),
while the batch grows and shrinks across graph paddings; GraphTimer regions inside the graphs
add up to the replay time. Skipped without a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")
pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    from gpu_shapes import write_shape_dir

    return write_shape_dir(str(tmp_path_factory.mktemp("shape")), "test-small")


def _llm(shape_dir, **kw):
    from deepinfer import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    llm = LLM(shape_dir, device="cuda", dtype="float32", dummy_weights=True, max_model_len=512, num_kv_blocks=256,
              max_num_seqs=32, max_num_batched_tokens=128, **kw)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # livelier than the dummy init: distinct greedy tokens
        for p in llm.runner.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return llm


def _scenario(llm):
    """Arrivals over several steps, different lengths, an abort mid-decode; tokens per request."""
    from deepinfer import SamplingParams

    rng = np.random.default_rng(0)
    eng = llm.engine
    plan = {0: 5, 2: 9, 5: 13, 9: 1}  # step -> new requests (batch 5 -> 14 -> 27 -> shrinking)
    tokens: dict[str, list[int]] = {}
    rows_seen: set[int] = set()
    step = 0
    while step < 400:
        for i in range(plan.get(step, 0)):
            rid = f"s{step}-{i}"
            n_in = int(rng.integers(3, 60))
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(4, 40)), ignore_eos=True)
            eng.add_request(rid, rng.integers(3, 1000, n_in).tolist(), params)
        if step == 7:
            eng.abort("s2-3")
        if step == 12:
            eng.abort("s5-0")
        for ro in eng.step():
            tokens[ro.request_id] = list(ro.outputs[0].token_ids)
        rows_seen.add(int(eng.args.num_rows))
        step += 1
        if not eng.has_unfinished() and step > max(plan):
            break
    return tokens, rows_seen


def test_graph_decode_matches_eager_greedy(shape_dir):
    from deepinfer.runtime.cuda_graph_runner import capture_decode_graphs

    eager, _ = _scenario(_llm(shape_dir, enforce_eager=True))
    llm = _llm(shape_dir)
    assert llm.runner.graphs is not None and llm.backend in ("cuda", "cpu")
    fused, rows = _scenario(llm)
    assert llm.runner.graphs.num_replays > 20
    assert {1, 2, 4, 8, 16, 32} & rows and len(rows & set(llm.runner.graphs.batch_sizes)) >= 3, rows
    assert set(fused) == set(eager)
    # The model's own forward replayed (no fused kernels): the eager ops exactly.
    sizes = llm.runner.graphs.batch_sizes
    llm2 = _llm(shape_dir)
    llm2.runner.graphs = None
    capture_decode_graphs(llm2.runner, llm2.engine.step_buffers, sizes, 512, fused=False)
    reference, _ = _scenario(llm2)
    same_ref = sum(reference[r] == eager[r] for r in eager)
    same_fused = sum(fused[r] == eager[r] for r in eager)
    print(f"graphs (model ops) identical to eager: {same_ref}/{len(eager)}; graphs (fused kernels): "
          f"{same_fused}/{len(eager)}; padded batch sizes replayed: {sorted(rows & set(sizes))}")
    assert same_ref == len(eager)
    assert same_fused == len(eager)


def test_fused_kernels_on_gpu():
    out = subprocess.run([sys.executable, os.path.join(HERE, "fused_kernels_check.py"), "cuda"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_graph_timer_regions_add_up_to_the_replay(shape_dir):
    from deepinfer import SamplingParams

    llm = _llm(shape_dir)
    graphs = llm.runner.graphs
    if graphs.timer is None:
        pytest.skip("no graph-timer backend (deepinfer-cuda / deepinfer-graph-timer not installed)")
    llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    timer = graphs.timer
    timer.enable()
    graph = graphs._graphs[8][0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay_ms = []
    for _ in range(50):
        start.record()
        timer.replay(graph)
        end.record()
        end.synchronize()
        replay_ms.append(start.elapsed_time(end))
    stats = timer.to_dict()
    inner = sum(s["mean_ms"] * s["count"] for n, s in stats.items() if n != "graph") / 50
    whole = stats["graph"]["mean_ms"]
    replay = float(np.median(replay_ms))
    print(f"regions {sorted(stats)}: inner regions sum to {inner:.4f} ms per replay, the 'graph' region "
          f"{whole:.4f} ms, replay between events outside the graph {replay:.4f} ms")
    # the regions tile the graph (gaps between nodes aside) within the timer's 10 % / 20 us error
    assert abs(inner - whole) <= max(0.10 * whole, 0.020)
    assert whole <= replay  # the launch and the first node's start are outside the graph's region
    timer.disable()
    start.record()
    for _ in range(50):
        graph.replay()  # disabled: no timer nodes in the executable graph
    end.record()
    end.synchronize()
    print(f"replay with the timer off: {start.elapsed_time(end) / 50:.4f} ms")


FAULT_SCRIPT = r'''
import os
import sys
sys.path.insert(0, sys.argv[2])
import torch
from deepinfer import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", dtype="float32", dummy_weights=True, max_model_len=512, num_kv_blocks=256,
          max_num_seqs=8, overlap_scheduling=sys.argv[3] == "1")
graphs = llm.runner.graphs
inner = graphs.replay
sides = [llm.engine.buffers] + ([b.arrays for b in llm.engine.overlap.buffers] if llm.engine.overlap else [])
def corrupt(rows, **kw):
    for arrays in sides:  # (the overlap loop alternates two host buffer sets)
        arrays["block_tables"][:rows] = 2 ** 30  # far outside the KV cache: the kernels fault
    return inner(rows, **kw)
graphs.replay = corrupt
try:
    llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
except RuntimeError as exc:
    print("raised RuntimeError:", str(exc).splitlines()[0], flush=True)
    os._exit(0)  # skip interpreter teardown: torch's destructors abort on the faulted context
print("no exception", flush=True)
os._exit(1)
'''


@pytest.mark.parametrize("overlap", ["0", "1"])
def test_a_fault_inside_a_replayed_graph_raises(shape_dir, overlap):
    # In a child process: a device fault leaves the CUDA context unusable for the rest of it.
    out = subprocess.run([sys.executable, "-c", FAULT_SCRIPT, shape_dir, HERE, overlap], capture_output=True,
                         text=True, timeout=300)
    print(out.stdout.strip())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "raised RuntimeError" in out.stdout

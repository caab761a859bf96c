"""Decode steps replayed from CUDA graphs give the eager path's greedy tokens (float32, TF32 off),
while the batch grows and shrinks across graph paddings (Llama, Qwen3 and Qwen3-MoE shapes); bf16 greedy
tokens match transformers; GraphTimer regions inside the graphs add up to the replay time, also in
cuBLAS graphs whose edges carry data. Skipped without a CUDA device."""

from __future__ import annotations

import copy
import math
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
    kw.setdefault("max_num_batched_tokens", 128)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("max_num_seqs", 32)
    llm = LLM(shape_dir, device="cuda", dtype="float32", dummy_weights=True, max_model_len=512, **kw)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # livelier than the dummy init: distinct greedy tokens
        for name, p in llm.runner.model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3: weights that matter
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
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
        rows_seen.add(int(eng.executor.args[eng.executor.side].num_rows))
        step += 1
        if not eng.has_unfinished() and step > max(plan):
            break
    return tokens, rows_seen


def test_graph_decode_matches_eager_greedy(shape_dir):
    from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs

    eager, _ = _scenario(_llm(shape_dir, enforce_eager=True))
    llm = _llm(shape_dir)
    assert llm.runner.graphs is not None and llm.backend in ("cuda", "cpu")
    fused, rows = _scenario(llm)
    assert llm.runner.graphs.num_replays > 20
    # prompt and mixed steps (max_num_batched_tokens=128) replayed step graphs (worker/step_graph_runner.py)
    assert llm.runner.step_graphs is not None and llm.runner.step_graphs.num_replays > 5
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


def _burst(seed: int, count: int, lengths: tuple[int, int]) -> list[list[int]]:
    """``count`` prompts of token ids, each of a length in ``lengths`` (a step-filling burst)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, int(rng.integers(*lengths))).tolist() for _ in range(count)]


def _greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (EOS ignored), all sent at once."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_step_graphs_up_to_2048_tokens_match_eager_greedy(shape_dir):
    """``LLM()``'s budget of 2048 tokens: a burst of prompts (~3,000 tokens) fills a 2048-token step
    and a ~1,000-token one, which replay the largest step graphs (``DEEPINFER_STEP_GRAPH_TOKENS``,
    2048 since 2026-12-06); the greedy tokens equal the eager run's."""
    prompts = _burst(3, 14, (150, 280))
    eager = _greedy(_llm(shape_dir, enforce_eager=True, max_num_batched_tokens=2048), prompts, 8)
    llm = _llm(shape_dir, max_num_batched_tokens=2048)
    graphs = llm.runner.step_graphs
    assert graphs is not None and graphs.token_counts[-2:] == [1024, 2048]
    assert _greedy(llm, prompts, 8) == eager
    assert graphs.num_replays >= 2


def test_small_models_step_graphs_up_to_8192_tokens_match_eager_greedy(shape_dir, monkeypatch):
    """``DEEPINFER_STEP_GRAPH_TOKENS=auto``: a model of hidden size up to 1024 (test-small: 256) has
    step graphs up to 8192 tokens under a budget of 8192. A burst of ~10,000 prompt tokens fills an
    8192-token step and a shorter one, which replay the largest graphs; the greedy tokens equal the
    eager run's."""
    monkeypatch.delenv("DEEPINFER_STEP_GRAPH_TOKENS", raising=False)
    prompts = _burst(5, 40, (200, 300))
    kw = dict(max_num_batched_tokens=8192, max_num_seqs=64, num_kv_blocks=1024)
    eager = _greedy(_llm(shape_dir, enforce_eager=True, **kw), prompts, 6)
    llm = _llm(shape_dir, **kw)
    graphs = llm.runner.step_graphs
    assert graphs is not None and graphs.token_counts[-3:] == [2048, 4096, 8192]
    counts: list[int] = []  # the graph each replayed step took
    count = graphs._count
    monkeypatch.setattr(graphs, "_count", lambda rows: counts.append(count(rows)) or counts[-1])
    assert _greedy(llm, prompts, 6) == eager
    assert 8192 in counts, counts


def test_out_of_memory_in_a_capture_drops_the_largest_graphs_only(shape_dir, monkeypatch):
    """A capture that runs out of device memory (raised inside the graph capture, as the caching
    allocator raises it) drops the largest token counts, captures the rest again and warns once;
    the steps that still fit a graph replay it and the greedy tokens equal the eager run's."""
    from deepinfer.runtime.worker import step_graph_runner

    forward = step_graph_runner.StepGraphs._forward

    def short_of_memory(self, tokens):
        if tokens > 512 and torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated in the capture)")
        return forward(self, tokens)

    monkeypatch.setattr(step_graph_runner.StepGraphs, "_forward", short_of_memory)
    large = _burst(4, 8, (100, 200))  # ~1,200 prompt tokens in the first step: past 512, eager
    small = _burst(5, 3, (100, 150))  # at most 450: the 512-token graph
    reference = _llm(shape_dir, enforce_eager=True, max_num_batched_tokens=2048)
    eager = [_greedy(reference, large, 6), _greedy(reference, small, 6)]
    with pytest.warns(RuntimeWarning, match=r"more than 512 tokens not captured: out of device memory .*simulated"):
        llm = _llm(shape_dir, max_num_batched_tokens=2048)
    graphs = llm.runner.step_graphs
    assert graphs is not None and graphs.token_counts[-1] == 512
    assert _greedy(llm, large, 6) == eager[0]
    before = graphs.num_replays
    assert _greedy(llm, small, 6) == eager[1]
    assert graphs.num_replays > before


@pytest.mark.parametrize("prefetch", ["0", "1"])
def test_qwen3_graph_decode_matches_eager_greedy(tmp_path, monkeypatch, prefetch):
    """Qwen3's q/k norm inside the fused rotary kernel: the replayed decode graphs give the eager
    path's greedy tokens (float32, TF32 off) across paddings, arrivals and aborts; also with the
    kernels' loads before their PDL wait (``DEEPINFER_PDL_PREFETCH=1``, read at capture), where a
    read of the new token's k/v before the rotary kernel stored it would change tokens."""
    from gpu_shapes import write_shape_dir

    monkeypatch.setenv("DEEPINFER_PDL_PREFETCH", prefetch)

    qwen3_dir = write_shape_dir(str(tmp_path), "test-small-qwen3")
    eager, _ = _scenario(_llm(qwen3_dir, enforce_eager=True))
    llm = _llm(qwen3_dir)
    assert llm.runner.model.config.qk_norm and llm.runner.graphs is not None
    fused, rows = _scenario(llm)
    same = sum(fused[r] == eager[r] for r in eager)
    print(f"qwen3 graphs (fused kernels) identical to eager: {same}/{len(eager)}; rows {sorted(rows)}")
    assert set(fused) == set(eager) and same == len(eager)


@pytest.mark.parametrize("in_o", ["0", "1"])
def test_qwen3_moe_graph_decode_matches_eager_greedy(tmp_path, monkeypatch, in_o):
    """A small Qwen3-MoE shape: the replayed decode graphs give the eager path's greedy tokens in
    the scenario above and for a request alone (the batch-1 graph). ``in_o=1``: the graphs are
    captured with the router in the o projection's launch (``DEEPINFER_MOE_ROUTER_IN_O``); the
    eager reference runs without it. The graphs are captured again after ``_llm`` rewrites the
    weights: the router-in-o path keeps weights derived from them (``W_r diag(g) W_o``), made
    when a forward runs outside a replay, and a graph captured before the rewrite would keep the
    old ones (the engine loads weights only before it captures)."""
    from deepinfer import SamplingParams
    from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs
    from gpu_shapes import write_shape_dir

    moe_dir = write_shape_dir(str(tmp_path), "test-small-moe")
    alone = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(7, 40))}]
    monkeypatch.setenv("DEEPINFER_MOE_ROUTER_IN_O", "0")
    eager_llm = _llm(moe_dir, enforce_eager=True)
    eager, _ = _scenario(eager_llm)
    eager_alone = list(eager_llm.generate(prompt, alone)[0].outputs[0].token_ids)
    del eager_llm
    monkeypatch.setenv("DEEPINFER_MOE_ROUTER_IN_O", in_o)
    llm = _llm(moe_dir)
    old = llm.runner.graphs
    assert old is not None
    llm.runner.graphs = None
    llm.runner.graphs = capture_decode_graphs(llm.runner, llm.engine.step_buffers, old.batch_sizes, old.max_model_len)
    del old
    fused, rows = _scenario(llm)
    fused_alone = list(llm.generate(prompt, alone)[0].outputs[0].token_ids)
    same = sum(fused[r] == eager[r] for r in eager)
    print(f"qwen3-moe graphs (router in o {in_o}) identical to eager: {same}/{len(eager)}; rows {sorted(rows)}; "
          f"alone {fused_alone == eager_alone}")
    assert set(fused) == set(eager) and same == len(eager)
    assert fused_alone == eager_alone


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_silu_in_gate_up_gives_the_same_tokens(shape_dir, monkeypatch, quantization):
    """bf16 and fp8 models: the batch-1 decode graphs with SiLU(gate)·up stored by the gate/up GEMV
    (``DEEPINFER_SILU_IN_GATE_UP=1``) give the same greedy tokens as with down's own SiLU·mul
    input: the same bits by construction (fused_kernels_check.py and fp8_kernels_check.py check
    the kernels bitwise)."""
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need a CUDA GPU with compute capability >= 8.9")
    from deepinfer import LLM, SamplingParams
    from deepinfer.runtime.models import llama_fused_decode
    from deepinfer.runtime.models.fp8_linear import Fp8Linear, quantize_fp8
    from deepinfer.runtime.worker.cuda_graph_runner import capture_decode_graphs

    llm = LLM(shape_dir, device="cuda", dtype="bfloat16", quantization=quantization, dummy_weights=True,
              max_model_len=512, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=128)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # livelier than the dummy init: distinct greedy tokens
        for module in llm.runner.model.modules():
            if isinstance(module, Fp8Linear):
                codes, scale = quantize_fp8(torch.randn(module.weight.shape, generator=gen) * 0.08)
                module.weight.copy_(codes)
                module.weight_scale.copy_(scale)
        for p in llm.runner.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    paired: list[bool] = []
    one_row = llama_fused_decode._one_row

    def spy(proj, x, name, **fusions):  # type: ignore[no-untyped-def]
        paired.append(bool(fusions.get("silu_out")))
        return one_row(proj, x, name, **fusions)

    monkeypatch.setattr(llama_fused_decode, "_one_row", spy)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(7, 40))}]
    tokens = {}
    for on in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_SILU_IN_GATE_UP", on)
        old = llm.runner.graphs
        assert old is not None
        llm.runner.graphs = None
        paired.clear()
        llm.runner.graphs = capture_decode_graphs(llm.runner, llm.engine.step_buffers, old.batch_sizes,
                                                  old.max_model_len)
        del old
        assert any(paired) == (on == "1"), paired  # the batch-1 graph took the paired epilogue, or did not
        tokens[on] = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    print(f"{quantization or 'bf16'} tokens, SiLU in down: {tokens['0']}; in gate/up: {tokens['1']}")
    assert len(set(tokens["0"])) > 3  # a model lively enough that a wrong activation would show
    assert tokens["1"] == tokens["0"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_greedy_matches_transformers(tmp_path, arch):
    """bf16 on the GPU, graphs on: the first 16 greedy tokens of a mixed batch (chunked prefill
    next to decodes, prompts of 3..70 tokens), judged against the float32 model as transformers'
    own bf16 ``generate`` of each prompt alone is judged.

    Each bf16 run rounds its own way, so on a random model whose top two logits are often a bf16
    ulp apart (logits of ~5: an ulp is 0.03) neither run follows the float32 model's tokens
    exactly. What a correct bf16 forward guarantees is that every token it picks is a near-tie of
    the float32 model at that point. So the float32 model reads each run's own tokens (teacher
    forcing), and at every step the gap between its best logit and the logit of the token the
    run chose is the run's error there. Ours must be no worse than transformers' bf16 run by more
    than 4 bf16 ulps of the logits' scale. (The earlier form compared our tokens with
    transformers' bf16 tokens at their first difference with a fixed 0.1; that gap holds both
    runs' errors, and transformers' alone reached 0.165 on the tiny Llama, so it failed on
    rounding that was not ours.)"""
    from deepinfer import LLM, SamplingParams
    from gpu_shapes import write_tokenizer
    from tiny_models import save_tiny_model

    hf32 = save_tiny_model(str(tmp_path), arch).to("cuda")
    hf = copy.deepcopy(hf32).to(torch.bfloat16)
    write_tokenizer(str(tmp_path), hf.config.vocab_size)  # the tiny model folder has none
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=32)
    assert llm.runner.graphs is not None
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, n).tolist() for n in (3, 70, 17, 9, 40, 5)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    def errors(prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, float]:
        """Per step: the float32 model's best logit minus its logit of the token chosen; and the
        largest |logit| seen (the scale of a bf16 ulp)."""
        with torch.no_grad():
            logits = hf32(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        return (logits.max(dim=1).values - chosen).cpu(), float(logits.abs().max())

    ours_worst, theirs_worst, scale, identical, ours_exact, theirs_exact = 0.0, 0.0, 0.0, 0, 0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        ours = list(out.outputs[0].token_ids)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        ours_err, s1 = errors(prompt, ours)
        theirs_err, s2 = errors(prompt, theirs)
        identical += ours == theirs
        ours_exact += bool((ours_err == 0).all())
        theirs_exact += bool((theirs_err == 0).all())
        ours_worst, theirs_worst = max(ours_worst, float(ours_err.max())), max(theirs_worst, float(theirs_err.max()))
        scale = max(scale, s1, s2)
        print(f"prompt of {len(prompt)}: largest float32 gap of a chosen token: ours {float(ours_err.max()):.4f}, "
              f"transformers' bf16 {float(theirs_err.max()):.4f}")
    ulp = 2.0 ** (math.floor(math.log2(scale)) - 7)  # bf16: 8 significant bits
    print(f"{arch} bf16: {identical}/{len(prompts)} identical to transformers' bf16 over 16 tokens; the float32 "
          f"model's own tokens: ours {ours_exact}, transformers' {theirs_exact}; largest gap ours {ours_worst:.4f}, "
          f"transformers' {theirs_worst:.4f} (bf16 ulp at the logits' scale {scale:.2f}: {ulp})")
    assert ours_worst <= theirs_worst + 4 * ulp, (ours_worst, theirs_worst, ulp)


def test_fused_kernels_on_gpu():
    out = subprocess.run([sys.executable, os.path.join(HERE, "fused_kernels_check.py"), "cuda"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_eager_steps_on_gpu(tmp_path, arch):
    """Eager CUDA steps of every shape through the fused kernels equal the model's own forward in
    float32, and in bf16 are as close to the float32 model as the torch ops' bf16 step (the
    interpreter runs float32 in test_fused_kernels.py)."""
    from tiny_models import save_tiny_model

    save_tiny_model(tmp_path, arch=arch)
    out = subprocess.run([sys.executable, os.path.join(HERE, "fused_step_check.py"), str(tmp_path), "cuda"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("step ") == 6, out.stdout


def test_graph_timer_regions_add_up_to_the_replay(shape_dir):
    from deepinfer import SamplingParams

    llm = _llm(shape_dir)
    graphs = llm.runner.graphs
    if graphs.timer is None:
        pytest.skip("no graph-timer backend (deepinfer-cuda / deepinfer-graph-timer not installed)")
    llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    timer = graphs.timer
    timer.enable()
    graph, handle = graphs._graphs[8][0], graphs.handles[8]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay_ms = []
    for _ in range(50):
        start.record()
        timer.replay(handle, stream=torch.cuda.current_stream())
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
        graph.replay()  # torch's executable graph: made without the timer nodes
    end.record()
    end.synchronize()
    print(f"replay with the timer off: {start.elapsed_time(end) / 50:.4f} ms")


def test_graph_timer_takes_cublas_graphs_with_data_edges():
    """bf16 one-row GEMMs of the Llama-3-8B shape: on Hopper cuBLAS launches them with programmatic
    dependent launch, whose graph edges carry data. The timer attaches, times, and its regions
    come out of the graph and back without changing what the graph computes."""
    pytest.importorskip("deepinfer_graph_timer", reason="deepinfer-graph-timer is not installed")
    try:
        import deepinfer._C.graph_timer as gt
    except ImportError as exc:
        pytest.skip(f"no graph-timer backend: {exc}")
    from deepinfer_graph_timer import GraphTimer

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    x @ w1.T @ w2.T  # cuBLAS set up outside the capture
    torch.cuda.synchronize()
    timer = GraphTimer(gt, enabled=False)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        with timer.region("graph"):
            with timer.region("up"):
                h = torch.nn.functional.linear(x, w1)
            with timer.region("down"):
                y = torch.nn.functional.linear(h, w2)
    handle = timer.attach(gt.GraphHandle(int(graph.raw_cuda_graph())))
    graph.instantiate()
    graph.replay()
    expect = y.clone()
    timer.enable()
    for _ in range(20):
        timer.replay(handle, stream=torch.cuda.current_stream())
    torch.testing.assert_close(y, expect, atol=0, rtol=0)
    stats = timer.to_dict()
    inner = stats["up"]["mean_ms"] + stats["down"]["mean_ms"]
    print(f"cuBLAS graph regions: up {stats['up']['mean_ms']:.4f} ms, down {stats['down']['mean_ms']:.4f} ms, "
          f"graph {stats['graph']['mean_ms']:.4f} ms")
    assert stats["up"]["count"] == 20 and stats["up"]["mean_ms"] > 0 and stats["down"]["mean_ms"] > 0
    assert abs(inner - stats["graph"]["mean_ms"]) <= max(0.10 * stats["graph"]["mean_ms"], 0.020)
    timer.disable()
    y.zero_()
    graph.replay()
    torch.testing.assert_close(y, expect, atol=0, rtol=0)


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
sides = [b.arrays for b in llm.engine.executor.buffers]
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


@pytest.mark.parametrize("overlap", [True, False], ids=["zos", "sync"])
def test_a_failed_replay_fails_its_step_and_the_engine_goes_on(shape_dir, overlap):
    """An exception raised in the replay path (after earlier replays of the same requests) fails
    that step's requests only: ``generate`` raises it, nothing stays scheduled, and later requests
    replay the graphs again and give the eager path's greedy tokens — with the overlap loop (a
    step may be running ahead when the replay fails) and without."""
    from deepinfer import SamplingParams

    llm = _llm(shape_dir, overlap_scheduling=overlap)
    graphs = llm.runner.graphs
    inner = graphs.replay
    calls = {"n": 0}

    def flaky(rows, **kw):  # kw: the overlap loop's host buffers and id resolution
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected replay failure")
        return inner(rows, **kw)

    graphs.replay = flaky
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with pytest.raises(RuntimeError, match="injected replay failure"):
        llm.generate([[5, 6, 7], [9, 10], [11, 12, 13, 14]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    replays = graphs.num_replays
    prompts = [[5, 6, 7], [9, 10], [21, 22, 23, 24, 25]]
    after = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert graphs.num_replays >= replays + 10
    eager = _llm(shape_dir, enforce_eager=True)
    expect = [list(o.outputs[0].token_ids) for o in eager.generate(prompts, params, use_tqdm=False)]
    assert after == expect

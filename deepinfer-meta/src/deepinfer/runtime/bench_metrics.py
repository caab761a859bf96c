"""What ``deepinfer bench`` measures around one ``LLM.generate`` call.

- output tok/s over the call's wall time;
- TTFT and TPOT percentiles from each request's engine metrics (arrival, first token, finish);
- device busy time: CUDA events around each decode-graph replay (its input copy included) and
  each eager model call; the GPU idle fraction is 1 - busy / wall. A replay interval is device
  work only; an eager interval also holds the gaps while the host launches its kernels and
  leaves out the eager sampler, so eager idle fractions are rough;
- MFU: the step FLOPs that ``deepinfer._C.engine.FlopsEstimator`` counts from each step's
  query and context lengths, over wall time and the device's dense bf16 peak;
- with ``profile``: the GraphTimer's per-region device times inside the replayed decode graphs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Dense bf16 tensor-core peaks (vendor datasheets, SXM parts), by a substring of the device name.
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device named ``device_name``, None when unknown."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


def flops_estimator(cfg: Any) -> Any:
    """A FlopsEstimator of a runtime ModelConfig. Mixture-of-experts models count the FLOPs a token
    really spends: the router, its top-k routed experts and the shared experts on each routing
    layer, the dense MLP on the others (a Qwen2-MoE shared expert counts as
    ``shared_intermediate_size / expert_intermediate_size`` experts, rounded: the estimator counts
    whole experts). MLA models (DeepSeek-V2/V3) are counted with multi-head projections of the
    query/key head width (``qk_nope_head_dim + qk_rope_head_dim``): an estimate, not their
    low-rank projections."""
    from deepinfer._C import engine

    moe: dict[str, Any] = {}
    if cfg.moe is not None:
        spec = cfg.moe
        moe = {"num_experts": spec.num_experts, "num_experts_per_tok": spec.top_k,
               "moe_intermediate_size": spec.expert_intermediate_size,
               "num_shared_experts": round(spec.shared_intermediate_size / spec.expert_intermediate_size),
               # only the number of dense layers matters to the count, not where they are
               "first_k_dense_layers": cfg.num_hidden_layers - len(spec.moe_layers)}
    head_dim = cfg.head_dim if cfg.mla is None else cfg.mla.qk_head_dim
    return engine.FlopsEstimator(hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                                 num_attention_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                                 head_dim=head_dim, intermediate_size=cfg.intermediate_size,
                                 vocab_size=cfg.vocab_size, **moe)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def runs_summary(name: str, values: list[float]) -> str:
    """``values`` (output tok/s of several runs) as ``bench/gpu_bench.py`` prints them: the
    median with the spread (min-max, and as a percentage of the median)."""
    import statistics

    med = statistics.median(values)
    return (f"{name}: median {med:,.1f} output tok/s (spread {min(values):,.1f}-{max(values):,.1f}, "
            f"{100 * (max(values) - min(values)) / med if med else 0.0:.1f} %, {len(values)} runs)")


@dataclass
class BenchReport:
    """The figures of one measured ``generate`` call."""

    requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    ttft_ms: list[float]
    tpot_ms: list[float]
    steps: int = 0
    device_busy_s: float | None = None
    flops: float = 0.0
    peak_flops: float | None = None
    regions: dict[str, dict[str, float]] = field(default_factory=dict)
    device: str = ""
    # speculative decoding over the call: acceptance_rate, mean_accepted_length, per_position (None: off)
    spec: dict[str, Any] | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def gpu_idle_fraction(self) -> float | None:
        if self.device_busy_s is None:
            return None
        return max(0.0, 1.0 - self.device_busy_s / self.wall_s)

    @property
    def mfu(self) -> float | None:
        if not self.peak_flops:
            return None
        return self.flops / self.wall_s / self.peak_flops

    def lines(self) -> list[str]:
        out = [f"{self.requests} requests in {self.wall_s:.2f} s: {self.requests / self.wall_s:.2f} requests/s, "
               f"{self.input_tokens / self.wall_s:.1f} input tok/s, {self.output_tok_s:.1f} output tok/s, "
               f"{(self.input_tokens + self.output_tokens) / self.wall_s:.1f} total tok/s ({self.device}; "
               f"{self.steps} steps)"]
        for name, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)):
            if v:
                out.append(f"{name} ms: p50 {_pct(v, 50):.2f}  p90 {_pct(v, 90):.2f}  p99 {_pct(v, 99):.2f}  "
                           f"mean {float(np.mean(v)):.2f}")
        if self.gpu_idle_fraction is not None and self.device_busy_s is not None:
            out.append(f"GPU idle fraction: {100 * self.gpu_idle_fraction:.1f} % "
                       f"(device busy {self.device_busy_s:.3f} s of {self.wall_s:.3f} s)")
        mfu, peak = self.mfu, self.peak_flops
        out.append(f"model FLOPs: {self.flops / 1e12:.2f} TFLOP, {self.flops / self.wall_s / 1e12:.2f} TFLOP/s"
                   + (f", MFU {100 * mfu:.2f} % of {peak / 1e12:.0f} TFLOP/s bf16" if mfu is not None and peak
                      else " (MFU: unknown device peak)"))
        if self.spec is not None:
            pos = " ".join(f"{p:.2f}" for p in self.spec["per_position"])
            out.append(f"speculative decoding: acceptance rate {self.spec['acceptance_rate']:.3f}, mean accepted "
                       f"length {self.spec['mean_accepted_length']:.2f}, per-position acceptance [{pos}] "
                       f"({self.spec['num_drafts']} verifying sequence-steps)"
                       + (f"; draft model {self.spec['draft_ms_per_step']:.2f} ms per drafting step, "
                          f"{100 * self.spec['draft_share']:.0f} % of the wall time" if "draft_ms_per_step" in self.spec
                          else ""))
        if self.regions:
            out.append("decode-graph regions (GraphTimer, per region instance):")
            width = max(len(n) for n in self.regions)
            for name, s in self.regions.items():
                out.append(f"  {name:<{width}}  count {int(s['count']):>7d}  mean {s['mean_ms'] * 1e3:9.2f} us  "
                           f"p50 {s['p50_ms'] * 1e3:9.2f} us  p99 {s['p99_ms'] * 1e3:9.2f} us")
        return out


class StepMeter:
    """While active, counts each engine step's FLOPs and, on CUDA, the device time of its model
    work: CUDA events around each graph replay (input copy included) and around each eager
    ``ModelRunner.execute``. The eager interval also holds the gaps between the step's kernels
    while the host launches them, and leaves out the eager sampler."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.engine = llm, llm.engine
        self.estimator = flops_estimator(llm.model_config)
        self.cuda = llm.device.type == "cuda"
        self.flops = 0.0
        self.steps = 0
        self._events: list[tuple[Any, Any]] = []
        self._patched: list[tuple[Any, str]] = []

    def _timed(self, obj: Any, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*a, **kw)
            end.record()
            self._events.append((start, end))
            return out

        setattr(obj, name, timed)
        self._patched.append((obj, name))

    def __enter__(self) -> StepMeter:
        executor = self.engine.executor
        launch = executor.launch

        def launch_counted(*args: Any, **kwargs: Any) -> Any:
            # every step, synchronous or launched ahead (overlap), goes through the one executor
            step = launch(*args, **kwargs)
            if step.logits_rows is not None:  # the model ran
                a = executor.buffers[executor.side].arrays
                n = int(step.args.num_seqs)  # real rows: padding rows are not the model's work
                self.flops += float(self.estimator.step_flops(np.diff(a["query_start_loc"][:n + 1]),
                                                              a["seq_lens"][:n], n))
                self.steps += 1
            return step

        executor.launch = launch_counted
        self._patched.append((executor, "launch"))
        if self.cuda:
            self._timed(self.llm.runner, "execute")
            if self.llm.runner.graphs is not None:
                self._timed(self.llm.runner.graphs, "replay")
        return self

    def __exit__(self, *exc: object) -> None:
        for obj, name in self._patched:
            delattr(obj, name)  # back to the class's method
        self._patched = []

    def device_busy_s(self) -> float | None:
        if not self.cuda:
            return None
        if self._events:
            self._events[-1][1].synchronize()
        return sum(s.elapsed_time(e) for s, e in self._events) / 1e3


def measure_generate(llm: Any, prompts: list[Any], params: Any, *, use_tqdm: bool = False,
                     profile: bool = False) -> BenchReport:
    """Run ``llm.generate(prompts, params)`` once under the meters; returns its BenchReport."""
    timer = llm.runner.graphs.timer if llm.runner.graphs is not None else None
    if profile and timer is not None:
        timer.reset()
        timer.enable()
    device = str(llm.device)
    if llm.device.type == "cuda":
        import torch

        torch.cuda.synchronize(llm.device)
        device = f"{torch.cuda.get_device_name(llm.device)}, {'eager' if llm.runner.graphs is None else 'CUDA graphs'}"
    speculator = getattr(getattr(llm, "engine", None), "speculator", None)
    before = speculator.stats.snapshot() if speculator is not None else None
    draft = getattr(speculator, "draft", None)  # (method "draft_model") its time and steps before the call
    draft_before = (draft.seconds, draft.num_steps) if draft is not None else None
    meter = StepMeter(llm)
    with meter:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
        if llm.device.type == "cuda":
            torch.cuda.synchronize(llm.device)
        wall = time.perf_counter() - t0
    ttft, tpot = [], []
    for o in outs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if m.get("first_token_time") is not None:
            ttft.append(1e3 * (m["first_token_time"] - m["arrival_time"]))
            if n > 1 and m.get("finished_time") is not None:
                tpot.append(1e3 * (m["finished_time"] - m["first_token_time"]) / (n - 1))
    regions: dict[str, dict[str, float]] = {}
    if profile and timer is not None:
        regions = timer.to_dict()
        timer.disable()
    name = device.split(",")[0]
    spec = None
    if speculator is not None and before is not None:
        now = speculator.stats
        drafts = now.num_drafts - before.num_drafts
        dtoks = now.num_draft_tokens - before.num_draft_tokens
        acc = now.num_accepted_tokens - before.num_accepted_tokens
        spec = {"num_drafts": drafts, "acceptance_rate": acc / dtoks if dtoks else 0.0,
                "mean_accepted_length": 1.0 + acc / drafts if drafts else 1.0,
                "per_position": [(a - b) / drafts if drafts else 0.0
                                 for a, b in zip(now.accepted_per_pos, before.accepted_per_pos, strict=True)]}
        if draft is not None and draft_before is not None:
            secs, steps = draft.seconds - draft_before[0], draft.num_steps - draft_before[1]
            spec.update(draft_ms_per_step=1e3 * secs / steps if steps else 0.0, draft_share=secs / wall)
    return BenchReport(
        requests=len(outs), input_tokens=sum(len(o.prompt_token_ids) for o in outs),
        output_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs), wall_s=wall, ttft_ms=ttft,
        tpot_ms=tpot, steps=meter.steps, device_busy_s=meter.device_busy_s(), flops=meter.flops,
        peak_flops=peak_flops(name) if llm.device.type == "cuda" else None, regions=regions, device=device,
        spec=spec)

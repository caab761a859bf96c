"""Prometheus metrics of the server, named after vLLM's (prefix ``deepinfer:``).

The engine thread updates them after every step; prometheus-client's metrics are thread-safe,
and each server has its own registry (several servers can live in one process, e.g. in tests).
With data-parallel replicas every series carries the replica's index as the label ``engine``
(vLLM's name); each replica records its updates (MetricsRecorder), the front end replays them.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets as vLLM's, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's buckets of its iteration_tokens_total and request_params_n histograms.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

#: label names of ``deepinfer:cache_config_info`` (vLLM's CacheConfig fields that apply here)
CACHE_INFO_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                     "num_cpu_blocks", "num_gpu_blocks")


def cache_info(llm: Any) -> dict[str, str]:
    """The labels of ``deepinfer:cache_config_info`` for an ``LLM`` (vLLM's names: its KV-cache
    blocks are ``num_gpu_blocks`` whatever the device; ``num_cpu_blocks`` is vLLM's swap space,
    which this engine does not have: ``None``)."""
    args = llm.engine_args
    return {"block_size": str(args.block_size), "cache_dtype": str(llm.dtype).replace("torch.", ""),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization), "num_cpu_blocks": "None",
            "num_gpu_blocks": str(llm.engine.cfg.num_blocks)}


#: finished_reason label values of ``deepinfer:request_success_total``.
FINISH_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            v = m * scale
            if v > max_model_len:
                return out
            out.append(float(v))
        scale *= 10



class MetricFamilies:
    """The metric families of one server in their own registry. ``per_engine``: every series
    also carries the label ``engine``, the index of the data-parallel replica it describes."""

    def __init__(self, max_model_len: int, per_engine: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.per_engine = per_engine
        labels = ["model_name", "engine"] if per_engine else ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"deepinfer:{name}", doc, [*labels, *extra], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"deepinfer:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(f"deepinfer:{name}", doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.finished = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.preemptions = counter("num_preemptions", "Sequences preempted (KV blocks reclaimed).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.stream_overflows = counter("stream_buffer_overflows",
                                        "Streams cut because their client read too slowly (--max-stream-buffer).")
        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.free_blocks = gauge("kv_cache_free_blocks", "Free KV-cache blocks (cached ones included).")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in all.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    REQUEST_BUCKETS)
        lengths = token_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests.", lengths)
        self.generation_len = histogram("request_generation_tokens",
                                        "Generated tokens of finished requests (all samples).", lengths)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.n_param = histogram("request_params_n", "The n request parameter.", N_BUCKETS)
        self.max_tokens_param = histogram("request_params_max_tokens", "The max_tokens request parameter.",
                                          lengths)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Time from first scheduling to the last token (RUNNING phase).",
                                        REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Time from first scheduling to the first token (PREFILL phase).",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time from the first token to the last (DECODE phase).", REQUEST_BUCKETS)
        # speculative decoding (vLLM's spec_decode_* names; EngineLoop.stats() adds their totals)
        self.spec_drafts = counter("spec_decode_num_drafts", "Sequence-steps that verified drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.", ("position",))
        self.cache_config = Gauge("deepinfer:cache_config_info", "Information of the KV cache's configuration.",
                                  [*CACHE_INFO_LABELS, *labels], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics:
    """Every metric of one engine, labelled with the served model name (and its replica index as
    ``engine`` when ``families`` is per-engine); a server of one engine makes its own families."""

    def __init__(self, model_name: str, max_model_len: int, num_blocks: int,
                 families: MetricFamilies | None = None, engine: int | None = None,
                 cache: dict[str, str] | None = None) -> None:
        f = families if families is not None else MetricFamilies(max_model_len)
        if f.per_engine != (engine is not None):
            raise ValueError("engine= names the replica exactly when the families are per-engine")
        self.families = f
        key = (model_name,) if engine is None else (model_name, str(engine))
        self.prompt_tokens = f.prompt_tokens.labels(*key)
        self.generation_tokens = f.generation_tokens.labels(*key)
        self.finished = {reason: f.finished.labels(*key, reason) for reason in FINISH_REASONS}
        self.preemptions = f.preemptions.labels(*key)
        self.prefix_queries = f.prefix_queries.labels(*key)
        self.prefix_hits = f.prefix_hits.labels(*key)
        self.stream_overflows = f.stream_overflows.labels(*key)
        self.running = f.running.labels(*key)
        self.waiting = f.waiting.labels(*key)
        self.kv_usage = f.kv_usage.labels(*key)
        self.free_blocks = f.free_blocks.labels(*key)
        f.total_blocks.labels(*key).set(num_blocks)
        self.free_blocks.set(num_blocks)
        self.ttft = f.ttft.labels(*key)
        self.itl = f.itl.labels(*key)
        self.e2e = f.e2e.labels(*key)
        self.queue_time = f.queue_time.labels(*key)
        self.prompt_len = f.prompt_len.labels(*key)
        self.generation_len = f.generation_len.labels(*key)
        self.iteration_tokens = f.iteration_tokens.labels(*key)
        self.n_param = f.n_param.labels(*key)
        self.max_tokens_param = f.max_tokens_param.labels(*key)
        self.inference_time = f.inference_time.labels(*key)
        self.prefill_time = f.prefill_time.labels(*key)
        self.decode_time = f.decode_time.labels(*key)
        if cache is not None:  # an info metric: a gauge of 1 whose labels carry the values
            f.cache_config.labels(*(cache[k] for k in CACHE_INFO_LABELS), *key).set(1)
        self._engine_totals: dict[str, int] = {}
        self._key = key
        self.spec = {"spec_decode_num_drafts": f.spec_drafts.labels(*key),
                     "spec_decode_num_draft_tokens": f.spec_draft_tokens.labels(*key),
                     "spec_decode_num_accepted_tokens": f.spec_accepted.labels(*key)}

    def observe_engine(self, stats: dict[str, Any]) -> None:
        """Gauges from ``Scheduler.get_stats()``; its running totals become counter increments."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"] + stats["num_preempted"])
        self.kv_usage.set(stats["kv_usage"])
        self.free_blocks.set(stats["num_free_blocks"])
        for key, metric in (("num_preemptions_total", self.preemptions),
                            ("prefix_cache_queries", self.prefix_queries),
                            ("prefix_cache_hits", self.prefix_hits)):
            now = int(stats[key])
            delta = now - self._engine_totals.get(key, 0)
            if delta > 0:
                metric.inc(delta)
            self._engine_totals[key] = now
        # ---- speculative decoding: totals present only when the engine speculates
        totals = {k: stats[k] for k in self.spec if k in stats}
        for i, n in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
            totals[f"per_pos:{i}"] = n
        for key, now in totals.items():
            delta = int(now) - self._engine_totals.get(key, 0)
            if delta > 0:
                metric = self.spec[key] if key in self.spec else \
                    self.families.spec_accepted_per_pos.labels(*self._key, key.split(":")[1])
                metric.inc(delta)
            self._engine_totals[key] = int(now)

    def engine_replaced(self) -> None:
        """A fresh scheduler counts from zero again: forget the old totals."""
        self._engine_totals.clear()

    def replay(self, events: list[tuple[Any, ...]]) -> None:
        """Apply, in order, the updates a replica's MetricsRecorder recorded."""
        for event in events:
            if event[0] == "observe_engine":
                self.observe_engine(event[1])
            elif event[0] == "engine_replaced":
                self.engine_replaced()
            else:
                _, name, key, op, value = event
                target = getattr(self, name) if key is None else getattr(self, name)[key]
                if op == "observe_many":
                    observe_all(target, value)
                else:
                    getattr(target, op)(value)

    def exposition(self) -> bytes:
        return self.families.exposition()


_VECTOR_MIN = 32  # values from which observe_all buckets them with numpy (256: ~47 us, the loop ~105)


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values`` (a labelled prometheus_client Histogram
    child), with one increment per bucket and one of the sum: every front end replays every
    step's inter-token latencies, and ``observe`` costs ~2 us a value (a Python loop over the
    bounds, two locked increments). The counts are those of ``observe``: a value goes to the first
    bucket whose bound it does not exceed. A Histogram without the attributes this relies on (a
    later prometheus_client) gets ``observe`` per value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    if len(values) >= _VECTOR_MIN:  # a step's worth (one per stream): numpy finds the buckets
        import numpy as np

        # side="left" is bisect_left; NaN sorts past +Inf, into the slot cut off here
        where = np.searchsorted(np.asarray(bounds, np.float64), np.asarray(values, np.float64), side="left")
        counts = np.bincount(where, minlength=len(bounds) + 1)[:len(bounds)].tolist()
    else:
        counts = [0] * len(bounds)
        for v in values:
            if v == v:  # (NaN exceeds no bound and is counted in no bucket, as observe does)
                counts[bisect_left(bounds, v)] += 1
    for bucket, n in zip(buckets, counts, strict=True):
        if n:
            bucket.inc(n)
    total.inc(sum(values))


# the counters and histograms an engine thread updates (MetricsRecorder records them all)
_RECORDED = ("prompt_tokens", "generation_tokens", "ttft", "itl", "e2e", "queue_time", "prompt_len",
               "generation_len", "iteration_tokens", "n_param", "max_tokens_param", "inference_time",
               "prefill_time", "decode_time")


class _RecordedMetric:
    """A counter or histogram child that records ``inc`` / ``observe`` instead of applying them."""

    def __init__(self, recorder: MetricsRecorder, name: str, key: str | None = None) -> None:
        self._incs, self._observed, self._id = recorder._incs, recorder._observed, (name, key)

    def inc(self, amount: float = 1) -> None:
        self._incs[self._id] = self._incs.get(self._id, 0) + amount

    def observe(self, value: float) -> None:
        values = self._observed.get(self._id)
        if values is None:
            self._observed[self._id] = [value]
        else:
            values.append(value)

    def observe_many(self, values: list[float]) -> None:
        """``observe`` each of ``values``, in order (the engine thread's per-step inter-token
        latencies: one call a step, not one per request)."""
        observed = self._observed.get(self._id)
        if observed is None:
            self._observed[self._id] = list(values)
        else:
            observed.extend(values)


class MetricsRecorder:
    """Stands in for ServerMetrics in an engine core's (or a data-parallel replica's) process: the
    engine thread updates it as it would the real metrics, and each front end replays what it
    recorded, so one piece of code does the counting either way. Within one ``take()`` the
    increments of a counter are summed and the observations of a histogram go as one list (a
    step of 256 requests is then two events, not 512: every front end replays every event)."""

    def __init__(self) -> None:
        self._events: list[tuple[Any, ...]] = []
        self._incs: dict[tuple[str, str | None], float] = {}
        self._observed: dict[tuple[str, str | None], list[float]] = {}
        for name in _RECORDED:
            setattr(self, name, _RecordedMetric(self, name))
        self.finished = {reason: _RecordedMetric(self, "finished", reason) for reason in FINISH_REASONS}

    def observe_engine(self, stats: dict[str, Any]) -> None:
        self._events.append(("observe_engine", dict(stats)))

    def engine_replaced(self) -> None:
        self._events.append(("engine_replaced",))

    def take(self) -> list[tuple[Any, ...]]:
        """The updates recorded since the last call (counters and histograms first: they do not
        depend on the engine's gauges, whose updates keep their order)."""
        out: list[tuple[Any, ...]] = [("metric", name, key, "inc", amount)
                                      for (name, key), amount in self._incs.items()]
        out += [("metric", name, key, "observe_many", values) for (name, key), values in self._observed.items()]
        out += self._events
        self._incs.clear()
        self._observed.clear()
        self._events = []
        return out

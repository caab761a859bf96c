"""Prometheus metrics of the server, named after vLLM's (prefix ``deepinfer:``).

The engine thread updates them after every step; prometheus-client's metrics are thread-safe,
and each server has its own registry (several servers can live in one process, e.g. in tests).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets as vLLM's, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

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


class ServerMetrics:
    """Every metric of one server, labelled with the served model name."""

    def __init__(self, model_name: str, max_model_len: int, num_blocks: int) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"deepinfer:{name}", doc, [*labels, *extra], registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"deepinfer:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(f"deepinfer:{name}", doc, labels, buckets=buckets, registry=r)

        m = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(m)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(m)
        finished = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.finished = {reason: finished.labels(m, reason) for reason in FINISH_REASONS}
        self.preemptions = counter("num_preemptions", "Sequences preempted (KV blocks reclaimed).").labels(m)
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.").labels(m)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.").labels(m)
        self.running = gauge("num_requests_running", "Sequences in the running batch.").labels(m)
        self.waiting = gauge("num_requests_waiting", "Sequences waiting (new or preempted).").labels(m)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).").labels(m)
        self.free_blocks = gauge("kv_cache_free_blocks", "Free KV-cache blocks (cached ones included).").labels(m)
        total = gauge("kv_cache_total_blocks", "KV-cache blocks in all.").labels(m)
        total.set(num_blocks)
        self.free_blocks.set(num_blocks)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.",
                              TTFT_BUCKETS).labels(m)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             ITL_BUCKETS).labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.",
                             REQUEST_BUCKETS).labels(m)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling.",
                                    REQUEST_BUCKETS).labels(m)
        lengths = token_buckets(max_model_len)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests.",
                                    lengths).labels(m)
        self.generation_len = histogram("request_generation_tokens",
                                        "Generated tokens of finished requests (all samples).", lengths).labels(m)
        self._engine_totals: dict[str, int] = {}

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

    def engine_replaced(self) -> None:
        """A fresh scheduler counts from zero again: forget the old totals."""
        self._engine_totals.clear()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

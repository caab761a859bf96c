"""``deepinfer serve --data-parallel-size 2 --api-server-count 2``: two front ends, each connected
to both engine cores (issue 25). Outputs equal ``LLM.generate``'s, requests spread over both
cores (every front end's /metrics shows each core's counts), a client that goes away has its
request aborted on its core (the blocks freed there), and a killed core fails only its own
requests (a 503 error event naming it) while the other core's streams run to their exact end;
/health then reports 503 naming it, new requests go to the live core, and SIGTERM ends every
process with status 0."""

from __future__ import annotations

import json
import os
import signal

import httpx
from conftest import metrics, wait_until
from test_engine_core import RawStream, greedy, pids, started, stopped

PROMPTS = ["Tell me a story", "Count to a hundred", "The capital of France", "Once upon a time"]


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_two_front_ends_over_two_cores_spread_requests_and_a_killed_core_fails_only_its_requests(reference_llm):
    proc, url, lines = started("--data-parallel-size", "2", "--api-server-count", "2", "--max-num-seqs", "4",
                               "--shutdown-timeout", "2")
    cores: list[int] = []
    try:
        cores = pids(lines, "engine core")
        fronts = pids(lines, "front ends")
        assert len(cores) == 2 and len(fronts) == 2
        # ---- outputs equal LLM.generate and both cores serve
        streams = [RawStream(url, {"prompt": p, "max_tokens": 16, "ignore_eos": True, "temperature": 0})
                   for p in PROMPTS]
        for s, p in zip(streams, PROMPTS, strict=True):
            assert s.status == 200
            assert s.events()[-1] == "[DONE]"
            assert s.text() == greedy(reference_llm, p, 16)
            s.close()
        m = metrics(url)  # one front end's view: each core's counts reach every front end
        served = [m[f"deepinfer:request_success_total{{engine={e},finished_reason=length}}"] for e in (0, 1)]
        assert sum(served) == len(PROMPTS) and min(served) >= 1, served
        generated = [m[f"deepinfer:generation_tokens_total{{engine={e}}}"] for e in (0, 1)]
        assert sum(generated) == 16 * len(PROMPTS)
        # ---- a client that goes away: the abort reaches its core, whose blocks are freed
        gone = [RawStream(url, {"prompt": p, "max_tokens": 300, "ignore_eos": True, "temperature": 0})
                for p in PROMPTS[:2]]
        for s in gone:
            assert s.events(2)
            s.close()

        def aborted_and_freed() -> bool:
            m = metrics(url)
            aborts = sum(m[f"deepinfer:request_success_total{{engine={e},finished_reason=abort}}"] for e in (0, 1))
            free = all(m[f"deepinfer:kv_cache_free_blocks{{engine={e}}}"] == m[f"deepinfer:kv_cache_total_blocks"
                                                                               f"{{engine={e}}}"] for e in (0, 1))
            return aborts == 2 and free

        wait_until(aborted_and_freed, 10, "each abort reached its core and freed the blocks")
        # ---- a killed core: its streams get an error event naming it, the others finish exactly
        # (four streams: whatever the split over the front ends, each core gets one or more)
        long = [RawStream(url, {"prompt": p, "max_tokens": 100, "ignore_eos": True, "temperature": 0})
                for p in PROMPTS]
        for s in long:
            assert s.status == 200 and s.events(1)
        os.kill(cores[1], signal.SIGKILL)
        health: list[httpx.Response] = []
        wait_until(lambda: health.append(httpx.get(f"{url}/health", timeout=5)) or health[-1].status_code == 503,
                   5, "/health reports the dead core")
        failed = finished = 0
        for s, p in zip(long, PROMPTS, strict=True):
            events = s.events()
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            if "error" in last:
                assert last["error"]["type"] == "service_unavailable" and "replica 1 died" in \
                    last["error"]["message"], last
                failed += 1
            else:
                assert s.text() == greedy(reference_llm, p, 100)
                finished += 1
            s.close()
        # each front end alternates its requests over the cores: both had some on each
        assert failed >= 1 and finished >= 1, (failed, finished)
        reason = health[-1].json()["error"]["message"]
        assert "replica 1 died" in reason and "1 of 2 replicas serving" in reason, reason
        for _ in range(3):  # both front ends (whichever accepts) send new requests to the live core
            again = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
            assert again.status_code == 200, again.text
            assert again.json()["choices"][0]["text"] == greedy(reference_llm, "The capital of France is", 4)
        wait_until(lambda: metrics(url).get("deepinfer:num_requests_running{engine=0}", -1) == 0, 10,
                   "nothing runs on the live core")
        assert proc.poll() is None  # the server serves on
    finally:
        stopped(proc)
    assert proc.returncode == 0
    assert all(_ended(pid) for pid in cores), "an engine core outlived the server"

"""``deepinfer serve --deterministic`` (issue 29): 64 greedy requests of the default model (its
Q4_1 weights, the default CPU path otherwise) sent together answer exactly as each sent alone.
Without the switch the same run differs in most of them (native decode beside torch prefill,
batch-dependent GEMMs): guide 05, "Deterministic (batch-invariant) steps"."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import read_until_listening, start_serve_process

SUBJECTS = ["the ocean", "Python", "a cat", "the moon", "bread", "music", "winter", "a robot", "chess",
            "trains", "coffee", "mountains", "history", "rain", "a library", "the sun"]
FORMS = ["Write one sentence about {}.", "Tell me a fact about {}:", "Q: What is {}?\nA:", "A short poem about {}:"]


def test_64_greedy_requests_together_equal_alone_when_served_deterministic():
    prompts = [FORMS[i % 4].format(SUBJECTS[i % 16]) + (" Be brief." if i >= 32 else "") for i in range(64)]
    # --dtype auto: the file's own weights (Q4_1), not the float32 of the other server tests
    proc = start_serve_process("--deterministic", "--dtype", "auto", "--max-num-seqs", "64",
                               "--max-num-batched-tokens", "256")
    lines: list[str] = []
    try:
        url = read_until_listening(proc, lines, 180)
        with httpx.Client(base_url=url, timeout=300) as client:
            def complete(prompt: str) -> str:
                r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 24,
                                                         "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "length"
                return choice["text"]

            with ThreadPoolExecutor(64) as pool:
                together = list(pool.map(complete, prompts))
            alone = [complete(p) for p in prompts]
    finally:
        proc.terminate()
        proc.wait(60)
    differ = [i for i, (a, b) in enumerate(zip(together, alone, strict=True)) if a != b]
    assert differ == [], f"{len(differ)} of 64 differ: {differ}"

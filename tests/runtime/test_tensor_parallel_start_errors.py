"""Tensor-parallel ranks that fail before they report: the error names the rank, its exit and
its stderr at once (not after the rendezvous timeout).

These live apart from test_tensor_parallel.py on purpose: that module's `pair` fixture keeps a
TP=2 LLM, and with it a torch.distributed process group, open until the module ends, and a
second tensor-parallel LLM in the same process is refused while one is open. pytest ends a
module's fixtures before it runs another module's tests, so here no group is open.
"""

from __future__ import annotations

import re
import sys
import time

import pytest
import torch
from tiny_models import save_tiny_model, save_tiny_tokenizer

pytest.importorskip("deepinfer_engine", reason="the C++ engine (deepinfer-engine) is not built/installed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch was built without torch.distributed / gloo", allow_module_level=True)

LLM_ARGS = dict(num_kv_blocks=96, block_size=4, max_model_len=128, max_num_batched_tokens=16,
                enable_prefix_caching=False)


def test_a_rank_failing_at_start_reports_its_error_and_stderr_at_once(tmp_path, monkeypatch):
    # rank 1 alone gets a device that cannot exist: it fails in its own process, before it
    # reaches rank 0's store, with torch's own error
    from deepinfer import LLM
    from deepinfer.runtime.distributed import launcher

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    monkeypatch.setattr(launcher, "check_devices", lambda n, device: ["cpu"] + ["no-such-device"] * (n - 1))
    start = time.monotonic()
    with pytest.raises(launcher.TensorParallelError) as info:
        LLM(str(tmp_path), tensor_parallel_size=2, **LLM_ARGS)
    assert time.monotonic() - start < 60  # not the rendezvous timeout
    message = str(info.value)
    first, _, tail = message.partition("\n")
    assert re.match(r"tensor-parallel rank 1 \(pid \d+\) exited with code 1: RuntimeError: .*no-such-device.*; "
                    r"the tensor-parallel LLM could not start$", first), message
    # the rank's stderr: its traceback, down to the line that failed
    assert tail.startswith("last ") and "lines of rank 1's stderr:" in tail, message
    assert "Traceback (most recent call last):" in tail and "torch.device(spec.devices[rank])" in tail, message
    assert "tensor-parallel rank 1 stops: RuntimeError" in tail, message
    assert not torch.distributed.is_initialized()


def test_a_rank_that_dies_before_reporting_is_named_with_its_stderr(tmp_path, monkeypatch):
    # a rank process that never gets to run deepinfer (a broken environment): no report of its
    # own, so its exit status and the last lines it printed are what the error says
    from deepinfer import LLM
    from deepinfer.runtime.distributed import launcher

    save_tiny_model(tmp_path, "llama")
    save_tiny_tokenizer(tmp_path)
    code = ("import sys\nfor i in range(30): print('noise', i, file=sys.stderr)\n"
            "print('rank', sys.argv[1], 'cannot import its runtime', file=sys.stderr)\nsys.exit(3)")
    monkeypatch.setattr(launcher, "rank_command", lambda rank: [sys.executable, "-c", code, str(rank)])
    start = time.monotonic()
    with pytest.raises(launcher.TensorParallelError) as info:
        LLM(str(tmp_path), tensor_parallel_size=2, **LLM_ARGS)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert re.match(r"tensor-parallel rank 1 \(pid \d+\) exited with code 3; the tensor-parallel LLM could "
                    r"not start\nlast 20 lines of rank 1's stderr:\n", message), message
    lines = message.splitlines()
    assert lines[-1] == "  | rank 1 cannot import its runtime"
    assert lines[2] == "  | noise 11"  # the last 20 lines only
    assert not torch.distributed.is_initialized()

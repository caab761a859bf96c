"""The tokenizer caches' temporary folders are removed on every path (issue 29, item 9): a failed
write, a read-only cache, and the loser of a race between processes (or threads) writing the same
entry -- several processes converting the default model's GGUF tokenizer on a fresh cache leave
one entry per cache and no ``<key>.tmp*`` folder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from deepinfer.runtime.loading import tokenizer_loader
from deepinfer.runtime.loading.tokenizer_loader import publish_cache_dir


def _leftovers(root) -> list[str]:
    return [os.path.join(d, n) for d, dirs, _ in os.walk(root) for n in dirs if ".tmp" in n]


def _write_files(text: str, delay: float = 0.0):
    def write(folder: str) -> None:
        time.sleep(delay)
        with open(os.path.join(folder, "f.txt"), "w") as f:
            f.write(text)
    return write


def test_publish_race_between_threads_keeps_one_entry_and_no_tmp(tmp_path):
    final = str(tmp_path / "cache" / "entry")
    won: list[bool] = []
    start = threading.Barrier(8)

    def run(i: int) -> None:
        start.wait()
        won.append(publish_cache_dir(final, _write_files(str(i), 0.05)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(won) == 1, won
    assert os.listdir(final) == ["f.txt"]
    assert _leftovers(tmp_path) == []


def test_publish_removes_tmp_on_failed_write_and_keeps_a_good_entry(tmp_path):
    final = str(tmp_path / "entry")

    def broken(folder: str) -> None:
        open(os.path.join(folder, "half"), "w").close()
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError):
        publish_cache_dir(final, broken)
    assert not os.path.exists(final) and _leftovers(tmp_path) == []
    assert publish_cache_dir(final, _write_files("a"))
    assert not publish_cache_dir(final, _write_files("b"))  # the existing entry is kept
    assert open(os.path.join(final, "f.txt")).read() == "a"
    assert publish_cache_dir(final, _write_files("c"), replace_existing=True)
    assert open(os.path.join(final, "f.txt")).read() == "c"
    assert _leftovers(tmp_path) == []


def test_publish_on_a_read_only_cache_returns_false(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert not publish_cache_dir(str(ro / "entry"), _write_files("x"))
    finally:
        ro.chmod(0o755)
    assert _leftovers(tmp_path) == []


def test_stale_tmp_folders_of_killed_writers_are_swept(tmp_path):
    stale = tmp_path / "entry.tmp_killed"
    stale.mkdir()
    old = time.time() - 2 * tokenizer_loader._STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    fresh = tmp_path / "other.tmp_running"  # another process's write in progress: kept
    fresh.mkdir()
    assert publish_cache_dir(str(tmp_path / "entry"), _write_files("x"))
    assert not stale.exists() and fresh.exists()


RACER = r"""
import sys, time
from deepinfer.runtime.loading.default_model import default_model_path
from deepinfer.runtime.loading.tokenizer_loader import load_text_tokenizer
path = default_model_path()
while time.time() < float(sys.argv[1]):
    time.sleep(0.005)
tok = load_text_tokenizer(path)
print(len(tok.encode("hello world")))
"""


def test_processes_racing_on_a_fresh_cache_leave_no_tmp_folders(tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, DEEPINFER_CACHE=str(cache))
    start = time.time() + 4.0  # every process imported and waiting before the race starts
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(start)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len({o[0] for o in outs}) == 1
    assert _leftovers(cache) == []
    for sub in ("tokenizers", "text-tokenizers"):
        assert len(os.listdir(cache / sub)) == 1, os.listdir(cache / sub)

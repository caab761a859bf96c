"""``bench/gguf_overrides.py``, the wrapper guide 08's GGUF sweeps and A/B runs cite: each variable
changes the one choice it names (``gguf_overrides_check.py`` in Triton's interpreter), malformed
values are ValueErrors naming the variable, and the runtime is restored after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "bench"))
pytest.importorskip("gguf", reason="gguf is not installed")

import gguf_overrides  # noqa: E402


def test_overrides_change_the_choices_they_name():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "gguf_overrides_check.py"), "cpu"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("value", ["4,512,1", "4,512,1,2,9", "4,x,1,2", "4,512,0,2", "-1,512,1,2"])
def test_a_malformed_tile_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("X_DP4A_64x256", value)
    with pytest.raises(ValueError, match="X_DP4A_64x256 must be four positive integers"):
        gguf_overrides.dp4a_tile(64, 256)


def test_tiles_and_span_read_as_given(monkeypatch):
    monkeypatch.delenv("X_DP4A_64x256", raising=False)
    monkeypatch.delenv("X_ARGMAX_SPAN", raising=False)
    assert gguf_overrides.dp4a_tile(64, 256) is None and gguf_overrides.argmax_span() is None
    monkeypatch.setenv("X_DP4A_64x256", "2,1024,1,2")
    assert gguf_overrides.dp4a_tile(64, 256) == (2, 1024, 1, 2)
    assert gguf_overrides.dp4a_tile(256, 64) is None  # another shape
    monkeypatch.setenv("X_ARGMAX_SPAN", "4096")
    assert gguf_overrides.argmax_span() == 4096
    for bad in ("0", "-3", "1e3", "many"):
        monkeypatch.setenv("X_ARGMAX_SPAN", bad)
        with pytest.raises(ValueError, match="X_ARGMAX_SPAN must be a positive integer"):
            gguf_overrides.argmax_span()


def test_gemm_tiles_and_splits_read_as_given(monkeypatch):
    for name in [n for n in os.environ if n.startswith("X_GEMM_")]:
        monkeypatch.delenv(name)
    assert gguf_overrides.gemm_tile("X_GEMM_TILE_FEW_ROWS") is None and gguf_overrides.few_rows_splits() == {}
    monkeypatch.setenv("X_GEMM_TILE_FEW_ROWS", "32,64,128,4,2")
    monkeypatch.setenv("X_GEMM_SPLITS_Q4_0", "4,2")
    assert gguf_overrides.gemm_tile("X_GEMM_TILE_FEW_ROWS") == (32, 64, 128, 4, 2)
    assert gguf_overrides.few_rows_splits() == {"Q4_0": (4, 2)}
    for bad in ("32,64,128,4", "32,64,128,4,0", "a,b,c,d,e"):
        monkeypatch.setenv("X_GEMM_TILE_FEW_ROWS", bad)
        with pytest.raises(ValueError, match="X_GEMM_TILE_FEW_ROWS must be five positive integers"):
            gguf_overrides.gemm_tile("X_GEMM_TILE_FEW_ROWS")
    for bad in ("4", "4,0", "4,2,1", "x,2"):
        monkeypatch.setenv("X_GEMM_SPLITS_Q4_0", bad)
        with pytest.raises(ValueError, match="X_GEMM_SPLITS_Q4_0 must be two positive integers"):
            gguf_overrides.few_rows_splits()

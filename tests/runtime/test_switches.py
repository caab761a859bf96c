"""Every DEEPINFER_* switch of the runtime is read in runtime/switches.py and listed in one doc table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deepinfer.runtime import switches

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _runtime_files():
    import deepinfer.runtime

    return sorted(Path(deepinfer.runtime.__file__).parent.rglob("*.py"))


def test_no_other_runtime_module_reads_a_deepinfer_variable():
    reads = re.compile(r"(os\.environ|os\.getenv|environ\.get)[^\n]*DEEPINFER_")
    offenders = [f"{p.name}: {m.group(0)}" for p in _runtime_files() if p.name != "switches.py"
                 for m in reads.finditer(p.read_text(encoding="utf-8"))]
    assert not offenders, offenders


def test_every_named_switch_constant_is_in_the_table():
    named = set()
    for p in _runtime_files():
        named |= set(re.findall(r"\"(DEEPINFER_[A-Z0-9_]+)\"", p.read_text(encoding="utf-8")))
    assert named <= set(switches.SWITCHES), named - set(switches.SWITCHES)


def test_the_doc_table_lists_exactly_the_switches():
    if not DOC.is_file():
        pytest.skip("docs/ is not beside the tests (an installed-only run)")
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### Environment switches", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(DEEPINFER_[A-Z0-9_]+)` \| `?([^|`]*)`? \|", section, re.M)
    assert {name: default.strip() for name, default in rows} == \
        {s.name: s.default for s in switches.SWITCHES.values()}


@pytest.mark.parametrize("text,on", [("0", False), ("false", False), ("No", False), (" off ", False),
                                     ("1", True), ("yes", True), ("", True)])
def test_boolean_switches(monkeypatch, text, on):
    monkeypatch.setenv("DEEPINFER_PDL", text)
    assert switches.enabled("DEEPINFER_PDL") is on


def test_unset_switch_takes_its_default(monkeypatch):
    monkeypatch.delenv("DEEPINFER_ONE_ROW_GEMV", raising=False)
    assert switches.value("DEEPINFER_ONE_ROW_GEMV") == "qkv,o,gate_up,down"
    assert switches.raw("DEEPINFER_ONE_ROW_GEMV") is None
    monkeypatch.setenv("DEEPINFER_CPU_NATIVE", "0")
    assert switches.native_cpu_decode_wanted() is False


@pytest.mark.parametrize("text,expected", [(" 8 ", 8), ("0", 0), ("4", 4)])
def test_integer_switches(monkeypatch, text, expected):
    monkeypatch.setenv("DEEPINFER_MOE_SMALL_BATCH", text)
    assert switches.integer("DEEPINFER_MOE_SMALL_BATCH") == expected


@pytest.mark.parametrize("text,expected", [("auto", None), (" AUTO ", None), ("0", 0), (" 64 ", 64)])
def test_integer_or_auto_switches(monkeypatch, text, expected):
    monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", text)
    assert switches.integer_or_auto("DEEPINFER_GGUF_DENSE_ROWS") == expected
    monkeypatch.setenv("DEEPINFER_GGUF_DENSE_ROWS", "automatic")
    with pytest.raises(ValueError, match="DEEPINFER_GGUF_DENSE_ROWS='automatic' is not an integer"):
        switches.integer_or_auto("DEEPINFER_GGUF_DENSE_ROWS")


@pytest.mark.parametrize("text,message", [("four", "is not an integer"), ("2.5", "is not an integer"),
                                          ("-1", "must be at least 0")])
def test_a_bad_integer_switch_is_a_value_error_naming_it(monkeypatch, text, message):
    import torch
    from deepinfer.runtime.models import moe

    monkeypatch.setenv("DEEPINFER_MOE_SMALL_BATCH", text)
    with pytest.raises(ValueError, match=f"DEEPINFER_MOE_SMALL_BATCH.*{message}"):
        switches.integer("DEEPINFER_MOE_SMALL_BATCH")
    monkeypatch.setattr(moe, "KERNELS_ON_CPU", True)  # the MoE layer's read, where it acts on it
    monkeypatch.setattr(moe, "_triton_available", lambda: True)
    with pytest.raises(ValueError, match="DEEPINFER_MOE_SMALL_BATCH"):
        moe._small_batch(torch.zeros(1, 4), moe.ExpertsSwiGLU(2, 4, 8))


@pytest.mark.parametrize("text,expected", [(" FP8 ", "fp8"), ("0", "0"), ("1", "1")])
def test_choice_switches(monkeypatch, text, expected):
    monkeypatch.setenv("DEEPINFER_SILU_IN_GATE_UP", text)
    assert switches.choice("DEEPINFER_SILU_IN_GATE_UP", ("0", "1", "fp8")) == expected
    monkeypatch.delenv("DEEPINFER_SILU_IN_GATE_UP")
    assert switches.choice("DEEPINFER_SILU_IN_GATE_UP", ("0", "1", "fp8")) == "fp8"  # the default


def test_a_bad_choice_switch_names_itself_and_the_options(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "cublas")
    with pytest.raises(ValueError, match=r"DEEPINFER_FP8_GEMM must be one of \['auto', 'triton'\], got 'cublas'"):
        switches.choice("DEEPINFER_FP8_GEMM", ("auto", "triton"))


def test_tile_switches(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MOE_TILES", " gate_up=1,2048,4 ; router=2,1024,2;")
    assert switches.tiles("DEEPINFER_MOE_TILES", ("gate_up", "down", "router"), (3,)) == \
        {"gate_up": (1, 2048, 4), "router": (2, 1024, 2)}
    monkeypatch.delenv("DEEPINFER_MOE_TILES")
    assert switches.tiles("DEEPINFER_MOE_TILES", ("gate_up", "down", "router"), (3,)) == {}
    monkeypatch.setenv("DEEPINFER_ONE_ROW_TILES", "down=4,2048,8,1,2;o=2,1024,4,3")
    assert switches.tiles("DEEPINFER_ONE_ROW_TILES", ("qkv", "o", "gate_up", "down"), (4, 5)) == \
        {"down": (4, 2048, 8, 1, 2), "o": (2, 1024, 4, 3)}


@pytest.mark.parametrize("text", ["gate=1,2048,4", "gate_up=1,2048", "gate_up=1,x,4", "gate_up=0,2048,4", "gate_up"])
def test_a_bad_tile_switch_names_itself(monkeypatch, text):
    monkeypatch.setenv("DEEPINFER_MOE_TILES", text)
    with pytest.raises(ValueError, match="DEEPINFER_MOE_TILES"):
        switches.tiles("DEEPINFER_MOE_TILES", ("gate_up", "down", "router"), (3,))



def test_the_moe_tile_switch_reaches_the_kernels(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    from deepinfer.runtime.kernels import moe_decode

    monkeypatch.delenv("DEEPINFER_MOE_TILES", raising=False)
    default = moe_decode._down_tile(1), moe_decode._router_tile(1), moe_decode._gate_up_tile(True)
    monkeypatch.setenv("DEEPINFER_MOE_TILES", "down=4,256,2;router=2,1024,2")
    assert moe_decode._down_tile(1) == (4, 256, 2) != default[0]
    assert moe_decode._router_tile(1) == (2, 1024, 2) != default[1]
    assert moe_decode._gate_up_tile(True) == default[2]  # not named: the default


def test_one_row_tiles_by_shape_and_switch(monkeypatch):
    """The one-row GEMV tiles: by K (small models), the narrowing o projection's own tile
    (Qwen3-30B-A3B's 4096 -> 2048), and the switch over both."""
    import torch
    from deepinfer.runtime.models import llama_fused_decode as fd

    monkeypatch.delenv("DEEPINFER_ONE_ROW_TILES", raising=False)
    w = lambda n, k: torch.empty(n, k, device="meta")  # noqa: E731
    assert fd._tile("o", w(4096, 4096)) == fd.ONE_ROW_CONFIGS["o"]  # Llama-3-8B: square
    assert fd._tile("o", w(2048, 4096)) == fd.NARROWING_O_CONFIG != fd.ONE_ROW_CONFIGS["o"]
    assert fd._tile("o", w(576, 576)) == fd.SMALL_K_CONFIGS["o"]
    assert fd._tile("qkv", w(5120, 2048)) == fd.ONE_ROW_CONFIGS["qkv"]
    monkeypatch.setenv("DEEPINFER_ONE_ROW_TILES", "o=2,1024,4,3")
    assert fd._tile("o", w(2048, 4096)) == (2, 1024, 4, 3)


def test_the_fp8_tile_switch_overrides_one_projection(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed (it ships with torch's CUDA wheels)")
    from deepinfer.runtime.kernels import fp8_gemv

    monkeypatch.delenv("DEEPINFER_FP8_ONE_ROW_TILES", raising=False)
    # K in one chunk and 4096 rows or more: 4 row tiles of 4 rows a program (BLOCK_K K's power of
    # two); K beyond 4096 or fewer rows (a small model): one tile a program
    default = fp8_gemv.one_row_config(4096, "f16", "gate_up", 28672)
    assert default == (4, 4096, 8, 2, 4)
    assert fp8_gemv.one_row_config(2880, "f16", "qkv", 4096) == (4, 4096, 8, 2, 4)
    assert fp8_gemv.one_row_config(576, "f16", "qkv", 960) == fp8_gemv.PROJECTION_CONFIGS[("qkv", "f16")]
    assert fp8_gemv.one_row_config(8192, "f16", "gate_up", 57344) == fp8_gemv.PROJECTION_CONFIGS[("gate_up", "f16")]
    assert fp8_gemv.one_row_config(4096, "f32", "gate_up", 28672) == fp8_gemv.PROJECTION_CONFIGS[("gate_up", "f32")]
    monkeypatch.setenv("DEEPINFER_FP8_ONE_ROW_TILES", "gate_up=8,1024,8,2")
    assert fp8_gemv.one_row_config(4096, "f16", "gate_up", 28672) == (8, 1024, 8, 2) != default
    assert fp8_gemv.one_row_config(4096, "f16", "down") == fp8_gemv.PROJECTION_CONFIGS[("down", "f16")]
    monkeypatch.setenv("DEEPINFER_FP8_ONE_ROW_TILES", "gate_up=8,1024,8")
    with pytest.raises(ValueError, match="DEEPINFER_FP8_ONE_ROW_TILES"):
        fp8_gemv.one_row_config(4096, "f16", "gate_up")


def test_the_silu_in_gate_up_switch_picks_the_gemvs(monkeypatch):
    """"fp8" (the default) pairs only fp8 gate/up projections, "1" plain bf16/fp16 ones too, "0"
    none; anything else is a ValueError naming the switch."""
    import torch
    from deepinfer.runtime.models.fp8_linear import Fp8Linear
    from deepinfer.runtime.models.llama_fused_decode import _silu_in_gate_up

    plain = torch.nn.Linear(8, 16, bias=False)
    fp8 = Fp8Linear(torch.zeros(16, 8).to(torch.float8_e4m3fn), torch.ones(16))
    monkeypatch.delenv("DEEPINFER_SILU_IN_GATE_UP", raising=False)
    assert (_silu_in_gate_up(fp8), _silu_in_gate_up(plain)) == (True, False)
    monkeypatch.setenv("DEEPINFER_SILU_IN_GATE_UP", "1")
    assert (_silu_in_gate_up(fp8), _silu_in_gate_up(plain)) == (True, True)
    monkeypatch.setenv("DEEPINFER_SILU_IN_GATE_UP", "0")
    assert (_silu_in_gate_up(fp8), _silu_in_gate_up(plain)) == (False, False)
    monkeypatch.setenv("DEEPINFER_SILU_IN_GATE_UP", "yes")
    with pytest.raises(ValueError, match=r"DEEPINFER_SILU_IN_GATE_UP must be one of \['0', '1', 'fp8'\], got 'yes'"):
        _silu_in_gate_up(plain)

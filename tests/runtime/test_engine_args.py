"""``EngineArgs``: every engine option in one dataclass, and what is generated from it.

Each field has help, a default, bounds and a flag; values out of bounds are refused naming the
option (in Python and on the command line); generate, chat, bench and serve take exactly the
same flags; the docs tables and ``LLM``'s docstring list every field; ``LLM(**kwargs)`` builds
it (unknown keywords named) and its ``__init__`` stays short.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys

import pytest
from deepinfer.runtime.engine_args import EngineArgs, options

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
# today's LLM keywords (a field may be added; none may go)
LLM_KEYWORDS = {"model", "device", "dtype", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization", "cpu_kv_cache_bytes",
                "num_kv_blocks", "dummy_weights", "attention_backend", "seed", "num_threads", "enforce_eager",
                "retry_failed_steps", "tensor_parallel_size", "overlap_scheduling"}


def _flags(opt) -> set[str]:
    return {opt.flag, f"--no-{opt.flag[2:]}"} if opt.kind == "bool" else {opt.flag}


ENGINE_FLAGS = set().union(*(_flags(o) for _, o in options()))


def test_every_llm_keyword_is_a_field_with_help_default_and_flag():
    assert LLM_KEYWORDS <= set(FIELDS)
    defaults = EngineArgs()
    for name, opt in options():
        assert len(opt.help) > 15 and "`" not in opt.help, name  # plain text: the CLI prints it
        assert opt.flag.startswith("--") and opt.kind in {"int", "float", "bool", "str", "choice", "json", "classes"}, name
        assert hasattr(defaults, name)
        if opt.kind == "int":
            assert opt.lo is not None and opt.upper() is not None, name
    flags = [o.flag for _, o in options()]
    assert len(set(flags)) == len(flags)
    assert dict(options())["num_threads"].flag == "--threads"  # the flag the CLI always had


def _out_of_bounds():
    """(field, a value out of its bounds, error) for every bounded field, both ends."""
    for name, opt in options():
        if opt.kind == "int":
            yield name, opt.lo - 1, ValueError
            yield name, opt.upper() + 1, ValueError
            yield name, 1.5, TypeError
            yield name, True, TypeError
        elif opt.kind == "float":
            yield name, opt.lo, ValueError
            yield name, opt.upper() + 0.5, ValueError
            yield name, "0.5", TypeError
        elif opt.kind == "bool":
            yield name, "yes", TypeError
            yield name, 1, TypeError
        elif opt.kind == "choice":
            yield name, "float64" if name == "dtype" else "flash", ValueError


@pytest.mark.parametrize(("name", "value", "error"), list(_out_of_bounds()))
def test_values_out_of_bounds_are_refused_naming_the_option(name, value, error):
    with pytest.raises(error, match=rf"^{name} must be"):
        EngineArgs(**{name: value})


def test_the_checks_keep_their_messages_and_normalise_numbers():
    import numpy as np

    with pytest.raises(ValueError, match=r"^block_size must be in \[1, 65536\], got 0$"):
        EngineArgs(block_size=0)
    with pytest.raises(TypeError, match=r"^max_num_seqs must be an integer, got '8'$"):
        EngineArgs(max_num_seqs="8")
    with pytest.raises(TypeError, match=r"^overlap_scheduling must be a bool or None, got 1$"):
        EngineArgs(overlap_scheduling=1)
    with pytest.raises(ValueError, match="overlap_scheduling=True does not run with tensor_parallel_size=2"):
        EngineArgs(overlap_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^device must be a string such as 'cpu'"):
        EngineArgs(device="")
    with pytest.raises(TypeError, match="^model must be a path"):
        EngineArgs(model=5)
    a = EngineArgs(seed=np.uint64(7), max_num_seqs=np.int32(4), model=__import__("pathlib").Path("/m"))
    assert (a.seed, a.max_num_seqs, a.model) == (7, 4, "/m")
    assert type(a.seed) is int and type(a.max_num_seqs) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.seed = 3  # type: ignore[misc]


def test_for_model_fills_and_checks_what_depends_on_the_model():
    a = EngineArgs().for_model(8192)
    assert (a.max_model_len, a.max_num_batched_tokens) == (8192, 2048)
    b = EngineArgs(enable_chunked_prefill=False).for_model(4096)
    assert (b.max_model_len, b.max_num_batched_tokens) == (4096, 4096)
    with pytest.raises(ValueError, match=r"^max_model_len must be in \[1, 4096\] for this model, got 5000$"):
        EngineArgs(max_model_len=5000).for_model(4096)
    with pytest.raises(ValueError, match="max_num_batched_tokens=512 must be >= max_model_len=1024 when chunked "
                                         "prefill is off"):
        EngineArgs(max_model_len=1024, max_num_batched_tokens=512, enable_chunked_prefill=False).for_model(4096)


def test_unknown_and_doubled_keywords_name_themselves():
    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword arguments 'max_num_seq', 'thread'"):
        EngineArgs.from_kwargs(None, {"max_num_seq": 8, "thread": 2})
    with pytest.raises(TypeError, match="multiple values for argument 'model'"):
        EngineArgs.from_kwargs("a.gguf", {"model": "b.gguf"})
    assert EngineArgs.from_kwargs(None, {"model": "b.gguf"}).model == "b.gguf"
    assert EngineArgs.from_kwargs("a.gguf", {"seed": 3}).to_kwargs() == {**EngineArgs().to_kwargs(),
                                                                          "model": "a.gguf", "seed": 3}


def test_llm_refuses_an_unknown_keyword_before_loading_anything():
    from deepinfer import LLM

    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword argument 'num_thread'"):
        LLM("/no/such/model.gguf", num_thread=2)


def test_llm_init_is_short_and_documents_every_option():
    from deepinfer.runtime.llm import LLM

    lines = inspect.getsource(LLM.__init__).splitlines()
    assert len(lines) <= 40, len(lines)
    params = inspect.signature(LLM.__init__).parameters
    assert list(params) == ["self", "model", "options"] and params["model"].default is None
    doc = inspect.getdoc(LLM)
    for name, opt in options():
        assert f"\n    {name}: " in doc and f"``{opt.flag}``" in doc, name


# ---- the command line ---------------------------------------------------------------------------
def _parsers() -> dict[str, argparse.ArgumentParser]:
    from deepinfer.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in ("generate", "chat", "bench", "serve")}


def _option_strings(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def test_generate_chat_bench_and_serve_take_the_same_engine_flags():
    parsers = _parsers()
    for name, p in parsers.items():
        flags = _option_strings(p)
        assert ENGINE_FLAGS <= flags, (name, ENGINE_FLAGS - flags)
        engine_dests = {a.dest for a in p._actions if set(a.option_strings) & ENGINE_FLAGS}
        assert engine_dests == set(FIELDS), name
    serve = _option_strings(parsers["serve"])
    assert {"--dummy-weights", "--overlap-scheduling", "--no-overlap-scheduling", "--data-parallel-size",
            "--port"} <= serve
    assert "--data-parallel-size" not in _option_strings(parsers["generate"])


def test_cli_values_round_trip_to_engine_args():
    parsers = _parsers()
    argv = ["--model", "m.gguf", "--device", "cpu", "--dtype", "bfloat16", "--max-model-len", "64", "--block-size", "8",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--no-enable-prefix-caching",
            "--no-enable-chunked-prefill", "--gpu-memory-utilization", "0.5", "--cpu-kv-cache-bytes", "4096",
            "--num-kv-blocks", "9", "--dummy-weights", "--attention-backend", "torch", "--seed", "5",
            "--threads", "3", "--enforce-eager", "--retry-failed-steps", "--tensor-parallel-size", "1",
            "--no-overlap-scheduling"]
    want = EngineArgs(model="m.gguf", device="cpu", dtype="bfloat16", max_model_len=64, block_size=8, max_num_seqs=4,
                      max_num_batched_tokens=128, enable_prefix_caching=False, enable_chunked_prefill=False,
                      gpu_memory_utilization=0.5, cpu_kv_cache_bytes=4096, num_kv_blocks=9, dummy_weights=True,
                      attention_backend="torch", seed=5, num_threads=3, enforce_eager=True,
                      retry_failed_steps=True, tensor_parallel_size=1, overlap_scheduling=False)
    for name, p in parsers.items():
        extra = ["x"] if name == "generate" else []
        assert EngineArgs.from_cli_args(p.parse_args([*extra, *argv])) == want, name
        assert EngineArgs.from_cli_args(p.parse_args(extra)) == EngineArgs(), name  # same defaults as LLM


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "0"], "argument --block-size: must be a positive integer, got 0"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer, got -1"),
    (["--threads", "5000"], "argument --threads: must be at most 4096, got 5000"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be in (0, 1], got 1.5"),
    (["--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
])
def test_cli_bounds_are_parser_errors_naming_the_flag(argv, message, capsys):
    for name, p in _parsers().items():
        with pytest.raises(SystemExit) as exit_info:
            p.parse_args([*(["x"] if name == "generate" else []), *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, name


def test_an_impossible_combination_is_one_line_and_exit_2_before_loading(capsys):
    from deepinfer.cli import main

    code = main(["generate", "x", "--model", "/no/such/model.gguf", "--overlap-scheduling",
                 "--tensor-parallel-size", "2"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["deepinfer generate: error: overlap_scheduling=True does not run with tensor_parallel_size=2 "
                   "yet; leave it unset (tensor-parallel steps run synchronously)"]


def test_help_lists_every_engine_flag_in_plain_text():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "deepinfer", "serve", "--help"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "model and engine:" in out.stdout and "`" not in out.stdout
    for flag in ENGINE_FLAGS:
        assert flag in out.stdout, flag
    assert "--max-num-seqs N" in out.stdout and "(default: 256)" in out.stdout
    assert "(default: False)" not in out.stdout  # a False default is not shown (as for every option)


# ---- the docs -----------------------------------------------------------------------------------
def test_the_docs_tables_are_generated_from_the_dataclass():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gen_engine_args_docs
    finally:
        sys.path.pop(0)
    assert gen_engine_args_docs.stale_pages() == [], "run python scripts/gen_engine_args_docs.py"
    table = EngineArgs.markdown_table()
    rows = [r for r in table.splitlines()[2:]]
    assert [r.split("|")[1].strip().strip("`") for r in rows] == FIELDS
    for name, opt in options():
        (row,) = [r for r in rows if r.startswith(f"| `{name}` |")]
        assert f"`{opt.flag}`" in row and f"`{getattr(EngineArgs(), name)!r}`" in row
    for page in gen_engine_args_docs.PAGES:
        assert table in page.read_text(), page

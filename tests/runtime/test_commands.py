"""The runtime's CLI subcommands: registration, options, and clean errors (exit status 2)."""

from __future__ import annotations

import argparse
import sys

import pytest
from deepinfer.cli import commands


def _parser():
    p = argparse.ArgumentParser(prog="deepinfer")
    sub = p.add_subparsers(dest="command")
    commands.register(sub)
    return p


def test_import_does_not_load_torch():
    import subprocess

    code = "import deepinfer, deepinfer.cli.commands, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_subcommands_and_sampling_flags():
    args = _parser().parse_args(["generate", "hi", "--temperature", "0.5", "--stop", "a", "--stop", "b", "-n", "2"])
    params = commands._sampling_params(args)
    assert params.temperature == 0.5 and params.stop_strings == ["a", "b"] and params.n == 2
    assert callable(args.func)
    for name in ("chat", "bench"):
        assert callable(_parser().parse_args([name]).func)


@pytest.mark.parametrize("argv", [["generate", "x", "--temperature", "-1"], ["generate", "x", "--top-p", "0"],
                                  ["generate", "x", "--model", "/no/such/model.gguf"]])
def test_bad_options_exit_2_with_a_message(argv, capsys):
    args = _parser().parse_args(argv)
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "error:" in err and ("temperature" in err or "top_p" in err or "/no/such/model.gguf" in err)


@pytest.mark.parametrize("flag,expected", [([], None), (["--overlap-scheduling"], True),
                                           (["--no-overlap-scheduling"], False)])
def test_overlap_scheduling_flag_reaches_the_llm(monkeypatch, flag, expected):
    import deepinfer.runtime.llm as llm_module

    seen = {}

    class FakeLLM:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(llm_module, "LLM", FakeLLM)
    for name in ("generate", "bench"):
        seen.clear()
        args = _parser().parse_args([name, *(["x"] if name == "generate" else []), *flag])
        commands._llm(args)
        assert seen["overlap_scheduling"] is expected


# ---- the guides agree with the command line (issue 26's first-hour papercuts) -----------------
_DOCS = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "guide"


def test_command_line_guide_lists_every_subcommand():
    import re

    from deepinfer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = (_DOCS / "09-command-line.md").read_text()
    listed = re.findall(r"^\| `deepinfer (\w+)", text, re.M)
    assert sorted(listed) == sorted(sub.choices)
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"has {words[len(sub.choices)]} subcommands" in text


def test_every_install_line_of_the_serving_guide_is_guide_01s():
    install = (_DOCS / "01-install.md").read_text()
    lines = [line.split("#")[0].strip() for line in (_DOCS / "10-serving.md").read_text().splitlines()
             if line.lstrip().startswith("pip install")]
    assert lines
    for line in lines:
        assert line in install, line  # never the package index's unrelated 'deepinfer'


def test_models_guide_says_the_default_model_runs_quantized():
    text = (_DOCS / "04-models.md").read_text()
    assert "no quantized kernels" not in text and "weights Q4_1, activations" in text

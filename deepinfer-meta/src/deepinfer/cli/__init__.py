"""deepinfer: run LLMs on DeepInfer's C++ engine (generate, chat, bench) and inspect the install (env).

Exit status: 0 success, 1 failure, 2 bad usage or bad input (one line on stderr),
130 interrupted (Ctrl-C), 141 stdout closed early (e.g. piped into head).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `yes | head` reports


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help with every option's default shown and descriptions kept as written.

    A default of None or False is not shown: such options say in words what happens.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """The parser of ``deepinfer`` and of each subcommand (so every one shows its defaults)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def installed_versions() -> list[tuple[str, str]]:
    """(distribution, version) of every installed deepinfer wheel, ``deepinfer`` first."""
    from importlib.metadata import distributions

    found: dict[str, str] = {}
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "deepinfer" or name.startswith("deepinfer-"):
            found.setdefault(name, dist.version)
    return sorted(found.items(), key=lambda kv: (kv[0] != "deepinfer", kv[0]))


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version of every installed deepinfer wheel and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        versions = installed_versions()
        if not any(name == "deepinfer" for name, _ in versions):
            import deepinfer

            here = os.path.dirname(os.path.dirname(os.path.abspath(deepinfer.__file__)))
            versions.insert(0, ("deepinfer", f"{deepinfer.__version__} (not installed: source tree {here})"))
        for name, version in versions:
            print(f"{name} {version}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="deepinfer", description=__doc__)
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True

    env = sub.add_parser(
        "env", help="versions, discovered backends, probe results and the selected backend"
    )
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.add_argument("--model", nargs="?", const="", default=None, metavar="PATH",
                     help="also build this model (no PATH: the default model) and print what runs per tensor "
                          "kind: weight type, kernel path, activation dtype")
    env.add_argument("--device", default=None, help="with --model: the device (default: the selected backend's)")
    env.add_argument("--dtype", default=None, help="with --model: the dtype (default: the device's)")
    env.add_argument("--quantization", default=None, help="with --model: quantize at load (fp8)")
    env.set_defaults(func=_env)

    try:
        import deepinfer.cli.commands as commands
    except ImportError as exc:  # the runtime's own dependencies are missing: env still works
        runtime_error = exc

        def _missing(args: argparse.Namespace) -> int:
            print(f"deepinfer: the runtime cannot be imported: {runtime_error}", file=sys.stderr)
            return 1

        for name in ("generate", "chat", "bench"):
            sub.add_parser(name, help="(runtime unavailable)").set_defaults(func=_missing)
    else:
        commands.register(sub)
    return parser


def _env(args: argparse.Namespace) -> int:
    from deepinfer.plugins.env_report import main

    if args.model is None:
        return main(as_json=args.json)
    from deepinfer.cli.commands import _run_guarded

    return _run_guarded(_env_what_runs, args)  # a bad option: one line on stderr, exit status 2


def _env_what_runs(args: argparse.Namespace) -> int:
    """The env report, then what runs in the built model (models/describe.py)."""
    from deepinfer.plugins.env_report import main
    from deepinfer.runtime.llm import LLM
    from deepinfer.runtime.worker.native_decode import kernel_paths

    llm = LLM(args.model or None, device=args.device, dtype=args.dtype, quantization=args.quantization)
    runner = llm.runner
    lines = kernel_paths(getattr(runner, "model", None), getattr(runner, "native_decode", None))
    if args.json:
        import json

        from deepinfer.plugins.env_report import collect

        print(json.dumps({**collect(), "what_runs": {"model": llm.model_path, "device": str(llm.device),
                                                    "lines": lines}}, indent=2))
        return 0
    main(as_json=False)
    print(f"\nWhat runs: {llm.model_path} on {llm.device}, per tensor kind")
    for line in lines:
        print(f"  {line}")
    return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; an unknown option is reported with the usage of the subcommand it was given to."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        owner = subparsers.choices.get(getattr(args, "command", None) or "", parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(build_parser(), argv)
        return int(args.func(args) or 0)
    except BaseException as exc:
        code = _exit_status_of(exc)
        if code is None:
            raise
        if code == EXIT_INTERRUPTED:
            print("deepinfer: interrupted", file=sys.stderr)
        else:  # the reader went away (``| head``): stop quietly, like other tools
            _quiet_stdout()
        return code


def _exit_status_of(exc: BaseException) -> int | None:
    """130 for Ctrl-C, 141 for a closed stdout, also when cleanup raised another error on top."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if isinstance(seen, BrokenPipeError):
            return EXIT_BROKEN_PIPE
        seen = seen.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())

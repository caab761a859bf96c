"""The ``deepinfer`` command: ``env`` here; ``generate``, ``chat``, ``bench`` from the runtime."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    env = sub.add_parser(
        "env", help="versions, discovered backends, probe results and the selected backend"
    )
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(func=lambda args: _env(args))

    try:
        import deepinfer.runtime.commands as commands
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

    return main(as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""Write the engine options table (from ``EngineArgs``) into the docs pages that show it.

    python scripts/gen_engine_args_docs.py          # rewrite the tables that differ
    python scripts/gen_engine_args_docs.py --check  # exit 1, naming them, when one differs

Each page holds the table between ``<!-- engine-args:begin -->`` and ``<!-- engine-args:end -->``.
The docs build (docs/conf.py) and tests/runtime/test_engine_args.py fail on a stale table, so
the docs cannot drift from the dataclass.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "guide" / "09-command-line.md", ROOT / "docs" / "api" / "runtime.md"]
BEGIN, END = "<!-- engine-args:begin -->", "<!-- engine-args:end -->"
_REGION = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)


def table() -> str:
    sys.path.insert(0, str(ROOT / "deepinfer-meta" / "src"))
    from deepinfer.runtime.engine_args import EngineArgs

    return EngineArgs.markdown_table()


def rendered(text: str, page: Path) -> str:
    """``text`` with its table region holding the current table (ValueError: no region)."""
    if len(_REGION.findall(text)) != 1:
        raise ValueError(f"{page}: needs exactly one {BEGIN} ... {END} region")
    return _REGION.sub(lambda _: f"{BEGIN}\n{table()}{END}", text)


def stale_pages() -> list[Path]:
    """The pages whose table differs from ``EngineArgs``'s."""
    return [p for p in PAGES if rendered(p.read_text(), p) != p.read_text()]


def main(argv: list[str]) -> int:
    stale = stale_pages()
    if "--check" in argv:
        for p in stale:
            print(f"{p.relative_to(ROOT)}: the engine options table is stale; run "
                  "python scripts/gen_engine_args_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(rendered(p.read_text(), p))
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

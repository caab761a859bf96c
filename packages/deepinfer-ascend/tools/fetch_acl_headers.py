"""Fetch the AscendCL headers that the torch-npu wheel ships, without installing torch-npu.

    python tools/fetch_acl_headers.py DEST [--version 2.14.0] [--wheel PATH]
    python tools/fetch_acl_headers.py --dest DEST ...

Downloads the wheel with ``pip download --no-deps`` (or uses ``--wheel``) and unpacks
``torch_npu/include/acl/**`` into ``DEST/acl``. Build with ``-DACL_INCLUDE_DIR=DEST``
or ``DEEPINFER_ACL_INCLUDE=DEST``. Prints DEST.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

_PREFIX = "torch_npu/include/"


def unpack_headers(wheel: Path, dest: Path) -> int:
    """Extract torch_npu/include/acl/** from ``wheel`` into ``dest``; return the file count."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if not name.startswith(_PREFIX + "acl/") or name.endswith("/"):
                continue
            target = dest / name[len(_PREFIX) :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
            count += 1
    if not (dest / "acl" / "acl.h").is_file():
        raise SystemExit(f"{wheel} has no torch_npu/include/acl/acl.h")
    return count


def download_wheel(version: str, into: Path) -> Path:
    """``pip download --no-deps torch-npu==version`` for this Python; return the wheel path."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(into),
            f"torch-npu=={version}",
        ],
        check=True,
    )
    wheels = sorted(into.glob("torch_npu-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download produced no torch_npu wheel in {into}")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, nargs="?", help="folder that will hold acl/acl.h")
    parser.add_argument("--dest", type=Path, dest="dest_option", help="same as the positional DEST")
    parser.add_argument("--version", default="2.14.0", help="torch-npu version to download")
    parser.add_argument(
        "--wheel", type=Path, help="use this torch-npu wheel instead of downloading"
    )
    args = parser.parse_args(argv)
    if (args.dest is None) == (args.dest_option is None):
        parser.error("give the destination folder once: DEST or --dest DEST")
    dest = (args.dest or args.dest_option).resolve()
    if (dest / "acl" / "acl.h").is_file():
        print(dest)
        return 0
    if args.wheel:
        unpack_headers(args.wheel, dest)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            unpack_headers(download_wheel(args.version, Path(tmp)), dest)
    print(dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

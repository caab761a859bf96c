"""Build the fake libascendcl.so (fake_ascendcl.c) and describe how to point the backend at it.

Used by tests/ascend and tests/conformance (loaded by file path: the test folders are not
packages). The library is compiled once per source/header content into a fixed folder
under the temp dir, as ``<folder>/lib64/libascendcl.so``, so every test process in a run
uses the same file (the backend keeps the first library it opened for the whole process).
The C compiler is ``$CC`` or ``cc``; the ACL headers come from ``DEEPINFER_ACL_INCLUDE``,
``ASCEND_TOOLKIT_HOME/include``, an installed torch_npu, or ``build/acl-include`` (what
``packages/deepinfer-ascend/tools/fetch_acl_headers.py build/acl-include`` writes, as the
nox build session does).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_ascendcl.c")
REPO_ROOT = Path(__file__).resolve().parents[3]
HARDWARE_ENV = "DEEPINFER_ASCEND_REAL"


class FakeAclBuildError(RuntimeError):
    """The fake library could not be built (no compiler or no ACL headers)."""


def acl_include_dir() -> Path:
    """The folder holding acl/acl.h, or FakeAclBuildError saying how to get one."""
    candidates: list[Path] = []
    if os.environ.get("DEEPINFER_ACL_INCLUDE"):
        candidates.append(Path(os.environ["DEEPINFER_ACL_INCLUDE"]))
    if os.environ.get("ASCEND_TOOLKIT_HOME"):
        candidates.append(Path(os.environ["ASCEND_TOOLKIT_HOME"]) / "include")
    spec = importlib.util.find_spec("torch_npu")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "include")
    candidates.append(REPO_ROOT / "build" / "acl-include")  # where `nox -s build` fetches them
    for folder in candidates:
        if (folder / "acl" / "acl.h").is_file():
            return folder
    raise FakeAclBuildError(
        "the ACL headers needed to compile the fake libascendcl.so were not found (tried "
        + ", ".join(map(str, candidates))
        + "); run: python packages/deepinfer-ascend/tools/fetch_acl_headers.py build/acl-include"
    )


def build_fake_library(defines: tuple[str, ...] = ()) -> Path:
    """Compile fake_ascendcl.c (once per content and ``-D`` defines) and return the path of
    libascendcl.so."""
    include = acl_include_dir()
    digest = hashlib.sha256(SOURCE.read_bytes() + repr(defines).encode())
    for header in sorted((include / "acl").rglob("*.h")):
        digest.update(header.read_bytes())
    home = Path(tempfile.gettempdir()) / f"deepinfer-fake-acl-{digest.hexdigest()[:16]}"
    library = home / "lib64" / "libascendcl.so"
    if library.is_file():
        return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FakeAclBuildError("no C compiler (cc/gcc, or $CC) to build the fake libascendcl.so")
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f"libascendcl.so.{os.getpid()}.tmp")
    cmd = [
        compiler,
        "-shared",
        "-fPIC",
        "-O1",
        "-g",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unused-parameter",
        *(f"-D{d}" for d in defines),
        f"-I{include}",
        str(SOURCE),
        "-o",
        str(partial),
        "-lpthread",
        "-lrt",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise FakeAclBuildError(
            f"building the fake libascendcl.so failed:\n{' '.join(cmd)}\n{done.stderr}"
        )
    partial.replace(library)  # atomic: concurrent test processes never see half a file
    return library


def use_real_hardware() -> bool:
    """True in the hardware session (nox -s tests_ascend_hardware sets DEEPINFER_ASCEND_REAL=1):
    no fake, the real library."""
    return os.environ.get(HARDWARE_ENV, "") not in ("", "0")

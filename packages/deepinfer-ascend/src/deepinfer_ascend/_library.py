"""Where ``libascendcl.so`` is: one search shared by the probe and the native module.

Order: ``DEEPINFER_ASCEND_LIBRARY`` (an explicit file, also how tests point the backend at
the fake library), ``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` (``lib64``), every folder
of ``LD_LIBRARY_PATH``, the default CANN install ``/usr/local/Ascend/ascend-toolkit/latest``,
then the dynamic linker's cache.
"""

from __future__ import annotations

import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

LIBRARY_NAME = "libascendcl.so"
LIBRARY_ENV = "DEEPINFER_ASCEND_LIBRARY"
_DEFAULT_TOOLKIT = "/usr/local/Ascend/ascend-toolkit/latest"


@dataclass(frozen=True)
class LibrarySearch:
    """The outcome of a search: ``path`` when found, otherwise ``reason`` says why not."""

    path: str | None
    reason: str
    searched: tuple[str, ...]


def _candidate_dirs() -> list[str]:
    dirs: list[str] = []
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        home = os.environ.get(var)
        if home:
            dirs += [os.path.join(home, "lib64"), os.path.join(home, "runtime", "lib64")]
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    dirs += [
        os.path.join(_DEFAULT_TOOLKIT, "lib64"),
        os.path.join(_DEFAULT_TOOLKIT, "runtime", "lib64"),
    ]
    return dirs


def find_library() -> LibrarySearch:
    """Locate libascendcl.so without loading it."""
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        if Path(explicit).is_file():
            return LibrarySearch(explicit, "", (explicit,))
        return LibrarySearch(
            None, f"{LIBRARY_ENV}={explicit!r} does not name an existing file", (explicit,)
        )
    searched = tuple(_candidate_dirs())
    for folder in searched:
        candidate = os.path.join(folder, LIBRARY_NAME)
        if os.path.isfile(candidate):
            return LibrarySearch(candidate, "", searched)
    if ctypes.util.find_library("ascendcl"):
        # Known to the dynamic linker's cache: dlopen resolves the bare name.
        return LibrarySearch(LIBRARY_NAME, "", (*searched, "ld.so.cache"))
    where = ", ".join(searched) if searched else "(no folder)"
    return LibrarySearch(
        None,
        f"{LIBRARY_NAME} not found (searched ASCEND_TOOLKIT_HOME, LD_LIBRARY_PATH and the "
        f"default CANN location: {where}; and the ld.so cache). Install the CANN toolkit and "
        f"run its set_env.sh, or set ASCEND_TOOLKIT_HOME.",
        (*searched, "ld.so.cache"),
    )


def library_path() -> str:
    """The path to dlopen; raises ImportError with the search's reason when there is none.

    Called by the native module the first time it needs ACL.
    """
    found = find_library()
    if found.path is None:
        raise ImportError(found.reason)
    return found.path

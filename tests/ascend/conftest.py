"""Fixtures of the Ascend backend tests: the fake libascendcl.so, its call log, error injection.

Every test here runs against tests/ascend/fake_acl/fake_ascendcl.c compiled by the session
fixture; the backend is pointed at it with DEEPINFER_ASCEND_LIBRARY. These tests check what
the backend asks of ACL (the call log) and how it reports ACL errors, so in the hardware
session (DEEPINFER_ASCEND_REAL=1) they are skipped and the conformance suite runs
against the real library instead.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

_HERE = Path(__file__).resolve().parent


def _fakeacl() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "deepinfer_tests_fakeacl", _HERE / "fake_acl" / "fakeacl.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fakeacl = _fakeacl()


@pytest.fixture(scope="session")
def fakeacl_module() -> ModuleType:
    """fake_acl/fakeacl.py: builds fake libraries (also variants with -D defines)."""
    return fakeacl


@pytest.fixture(scope="session")
def fake_library() -> Path:
    if fakeacl.use_real_hardware():
        pytest.skip(
            "hardware session (DEEPINFER_ASCEND_REAL=1): these tests check the fake ACL's call log"
        )
    library = fakeacl.build_fake_library()
    os.environ["DEEPINFER_ASCEND_LIBRARY"] = str(library)
    return library


@pytest.fixture(scope="session")
def native(fake_library: Path) -> ModuleType:
    from deepinfer_ascend.plugin import deepinfer_backend

    return deepinfer_backend()["load"]()


@dataclass(frozen=True)
class Call:
    pid: int
    name: str
    args: dict[str, str]
    rc: int


_FIELD = re.compile(r"(\w+)=(\S*)")


class CallLog:
    """The fake's call log for one test: one Call per ACL call, from every process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def calls(self, pid: int | None = None) -> list[Call]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            head, _, rest = line.partition(" ")
            name, _, fields = rest.partition(" ")
            args = dict(_FIELD.findall(fields))
            rc = int(args.pop("rc"))
            if pid is None or int(head) == pid:
                out.append(Call(int(head), name, args, rc))
        return out

    def names(self, pid: int | None = None) -> list[str]:
        return [c.name for c in self.calls(pid)]

    def of(self, name: str, pid: int | None = None) -> list[Call]:
        return [c for c in self.calls(pid) if c.name == name]

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@pytest.fixture
def acl_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: ModuleType
) -> Iterator[CallLog]:
    path = tmp_path / "acl_calls.log"
    monkeypatch.setenv("DEEPINFER_FAKE_ACL_LOG", str(path))
    yield CallLog(path)


@pytest.fixture
def inject(monkeypatch: pytest.MonkeyPatch, native: ModuleType):
    """inject("aclrtMalloc", 207001): that ACL call fails with that code until the test ends."""

    def _inject(call: str, code: int) -> None:
        monkeypatch.setenv("DEEPINFER_FAKE_ACL_FAIL", f"{call}:{code}")

    return _inject


@pytest.fixture
def fake(native: ModuleType):
    """ctypes handle on the fake library (the same instance the backend uses)."""
    import ctypes

    lib = ctypes.CDLL(os.environ["DEEPINFER_ASCEND_LIBRARY"])
    lib.deepinfer_fake_acl_launch_kernel.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    return lib


@pytest.fixture
def stream(fake) -> int:
    import ctypes

    fake.aclInit(None)  # may already be initialised by the backend: ACL_ERROR_REPEAT_INITIALIZE
    assert fake.aclrtSetDevice(0) == 0  # streams need a device set on this thread
    s = ctypes.c_void_p()
    assert fake.aclrtCreateStream(ctypes.byref(s)) == 0
    return int(s.value or 0)

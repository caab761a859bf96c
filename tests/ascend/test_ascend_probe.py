"""The probe: each way the backend can be unavailable has its own reason; no device init."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
from deepinfer_ascend import _library, _probe
from deepinfer_ascend.plugin import deepinfer_backend

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "deepinfer-ascend"


@pytest.fixture
def no_library_env(monkeypatch, tmp_path):
    """An environment with no libascendcl.so anywhere the search looks."""
    for var in ("DEEPINFER_ASCEND_LIBRARY", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(_library, "_DEFAULT_TOOLKIT", str(tmp_path / "no-cann"))
    monkeypatch.setattr(_library.ctypes.util, "find_library", lambda name: None)
    return tmp_path


def test_no_library_reason(no_library_env):
    result = _probe.probe()
    empty, cann = no_library_env / "empty", no_library_env / "no-cann"
    assert result == {
        "available": False,
        "reason": (
            "libascendcl.so not found (searched ASCEND_TOOLKIT_HOME, LD_LIBRARY_PATH and the default CANN "
            f"location: {empty}, {cann}/lib64, {cann}/runtime/lib64; and the ld.so cache). Install the CANN "
            "toolkit and run its set_env.sh, or set ASCEND_TOOLKIT_HOME."
        ),
        "details": {},
    }


def test_explicit_library_that_does_not_exist(no_library_env, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ASCEND_LIBRARY", "/nowhere/libascendcl.so")
    result = _probe.probe()
    assert not result["available"]
    assert (
        result["reason"]
        == "DEEPINFER_ASCEND_LIBRARY='/nowhere/libascendcl.so' does not name an existing file"
    )


def test_library_that_cannot_load(no_library_env, monkeypatch, tmp_path):
    bogus = tmp_path / "libascendcl.so"
    bogus.write_text("not an ELF file")
    monkeypatch.setenv("DEEPINFER_ASCEND_LIBRARY", str(bogus))
    result = _probe.probe()
    assert not result["available"]
    assert result["reason"].startswith(f"libascendcl.so at {bogus} could not be loaded: ")


def test_found_through_ascend_toolkit_home(no_library_env, monkeypatch, fake_library):
    monkeypatch.setenv(
        "ASCEND_TOOLKIT_HOME", str(fake_library.parent.parent)
    )  # <home>/lib64/libascendcl.so
    result = _probe.probe()
    assert result["available"], result["reason"]
    assert result["details"]["library"] == str(fake_library)


def test_found_through_ld_library_path(no_library_env, monkeypatch, fake_library):
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/nonexistent{os.pathsep}{fake_library.parent}")
    result = _probe.probe()
    assert result["available"], result["reason"]
    assert result["details"]["library"] == str(fake_library)


def test_available_with_device_count_and_version(fake_library, monkeypatch):
    monkeypatch.setenv("DEEPINFER_FAKE_ACL_DEVICE_COUNT", "3")
    monkeypatch.setenv("DEEPINFER_FAKE_ACL_CANN_VERSION", "8.3.RC1")
    result = _probe.probe()
    assert result["available"] is True and result["reason"] == ""
    assert result["details"]["device_count"] == "3"
    assert result["details"]["cann_version"] == "8.3.RC1"
    assert result["details"]["library"] == str(fake_library)
    assert "fake_acl" in result["details"]


def test_no_device(fake_library, monkeypatch):
    monkeypatch.setenv("DEEPINFER_FAKE_ACL_DEVICE_COUNT", "0")
    result = _probe.probe()
    assert not result["available"]
    assert result["reason"] == (
        f"libascendcl.so loaded from {fake_library} but no Ascend NPU is visible (aclrtGetDeviceCount "
        "returned 0; check the driver and ASCEND_RT_VISIBLE_DEVICES)"
    )
    assert result["details"]["device_count"] == "0"


@pytest.mark.parametrize(
    ("call", "code"), [("aclrtGetDeviceCount", 507033), ("aclsysGetCANNVersion", 100000)]
)
def test_each_failing_query_has_its_reason(fake_library, monkeypatch, call, code):
    monkeypatch.setenv("DEEPINFER_FAKE_ACL_FAIL", f"{call}:{code}")
    result = _probe.probe()
    assert not result["available"]
    assert result["reason"] == f"{call} failed with ACL error {code}"


def test_probe_initialises_nothing(fake_library, tmp_path):
    # In a fresh process: the probe may only query, never aclInit or set a device.
    log = tmp_path / "calls.log"
    code = "from deepinfer_ascend.plugin import deepinfer_backend as d; assert d()['probe']()['available']"
    env = dict(
        os.environ, DEEPINFER_FAKE_ACL_LOG=str(log), DEEPINFER_ASCEND_LIBRARY=str(fake_library)
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    names = [line.split()[1] for line in log.read_text().splitlines()]
    assert names == ["aclrtGetDeviceCount", "aclsysGetCANNVersion"]


def test_plugin_description():
    d = deepinfer_backend()
    assert set(d) == {
        "name",
        "distribution",
        "version",
        "plugin_api_version",
        "priority",
        "probe",
        "load",
    }
    assert (d["name"], d["distribution"], d["version"], d["plugin_api_version"], d["priority"]) == (
        "ascend",
        "deepinfer-ascend",
        "0.1.0",
        1,
        90,
    )
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert project["version"] == d["version"]
    assert project["entry-points"]["deepinfer.backends"] == {"ascend": "deepinfer_ascend.plugin"}


def test_plugin_matches_the_hookspec_and_never_imports_deepinfer():
    # Registered with the meta package's hookspec in a process where `deepinfer` is not imported
    # by the plugin itself (the hookspec file is loaded by path).
    hookspecs = (
        Path(__file__).resolve().parents[2]
        / "deepinfer-meta"
        / "src"
        / "deepinfer"
        / "plugins"
        / "hookspecs.py"
    )
    code = textwrap.dedent(
        f"""
        import importlib.util, sys, pluggy
        import deepinfer_ascend.plugin as plugin
        assert not any(m == "deepinfer" or m.startswith("deepinfer.") for m in sys.modules), sorted(sys.modules)
        spec = importlib.util.spec_from_file_location("hookspecs", {str(hookspecs)!r})
        hs = importlib.util.module_from_spec(spec); spec.loader.exec_module(hs)
        pm = pluggy.PluginManager("deepinfer"); pm.add_hookspecs(hs); pm.register(plugin)
        (desc,) = pm.hook.deepinfer_backend()
        assert desc["plugin_api_version"] == hs.PLUGIN_API_VERSION
        print(desc["name"])
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ascend"


def test_fetch_acl_headers_unpacks_a_wheel(tmp_path):
    import zipfile

    wheel = tmp_path / "torch_npu-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("torch_npu/include/acl/acl.h", "/* acl */")
        zf.writestr("torch_npu/include/acl/error_codes/rt_error_codes.h", "/* codes */")
        zf.writestr("torch_npu/include/other/x.h", "/* not acl */")
    dest = tmp_path / "inc"
    tool = PACKAGE / "tools" / "fetch_acl_headers.py"
    subprocess.run(
        [sys.executable, str(tool), str(dest), "--wheel", str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (dest / "acl" / "acl.h").read_text() == "/* acl */"
    assert (dest / "acl" / "error_codes" / "rt_error_codes.h").is_file()
    assert not (dest / "other").exists()
    shutil.rmtree(dest)

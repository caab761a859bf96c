"""Every rule of the plugin registry (docs/plugins.md), through installed distributions.

The fixture venv holds the real ``deepinfer`` wheel and seven fake backend wheels
(tests/registry/fake_backends.py). Each test only sets DEEPINFER_* variables.
"""

from __future__ import annotations

from pathlib import Path


def _backends(report: dict) -> dict[str, dict]:
    return {b["entry_point"]: b for b in report["backends"]}


def test_discovery_lists_every_entry_point_with_its_distribution(venv):
    report = venv.env_report()
    backends = _backends(report)
    assert set(backends) == {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "omega"}
    assert backends["alpha"]["distribution"] == "fake-backend-alpha"
    assert backends["alpha"]["distribution_version"] == "1.2.3"
    assert backends["alpha"]["priority"] == 50
    assert report["packages"]["deepinfer"] is not None  # the real wheel, not the source tree


def test_highest_priority_available_backend_wins(venv):
    # alpha (50) and omega (10) available; beta (70) unavailable; zeta (80) probe raises.
    proc = venv.run(
        "import deepinfer._C.cuda_utils as cu, deepinfer._C.graph_timer as gt;"
        "print(cu.alloc_tensor()[0], gt.GraphHandle.backend)",
        DEEPINFER_PLUGINS="alpha,beta,omega,zeta",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["alpha", "alpha"]


def test_equal_priority_is_an_error_naming_both_and_the_fix(venv):
    err = venv.import_error("deepinfer._C.cuda_utils", DEEPINFER_PLUGINS="alpha,epsilon")
    assert "'alpha', 'epsilon' are all available with the same priority 50" in err
    assert "DEEPINFER_BACKEND=<name>" in err


def test_forced_backend_wins_over_priority(venv):
    proc = venv.run(
        "import deepinfer._C.cuda_utils as cu; print(cu.alloc_tensor()[0])",
        DEEPINFER_PLUGINS="alpha,epsilon,omega", DEEPINFER_BACKEND="omega",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "omega"


def test_forced_unavailable_backend_says_why_and_how_to_fix(venv):
    err = venv.import_error("deepinfer._C.cuda_utils", DEEPINFER_BACKEND="beta")
    assert "DEEPINFER_BACKEND='beta' forces backend 'beta', which cannot be used" in err
    assert "no beta device found (fake)" in err
    assert "unset DEEPINFER_BACKEND" in err


def test_forced_unknown_backend_lists_what_is_installed(venv):
    err = venv.import_error("deepinfer._C.graph_timer", DEEPINFER_BACKEND="cuda")
    assert "DEEPINFER_BACKEND='cuda', but no backend of that name is installed" in err
    assert "alpha (entry point 'alpha' from fake-backend-alpha 1.2.3): available" in err
    assert 'pip install --no-index --find-links dist "deepinfer[cuda]"' in err


def test_plugin_api_mismatch_names_both_versions_and_the_fix(venv):
    err = venv.import_error("deepinfer._C.cuda_utils", DEEPINFER_BACKEND="delta")
    assert "fake-backend-delta 1.2.3 was built for deepinfer plugin API 99" in err
    assert "speaks plugin API 1" in err
    assert "pip install --no-index --find-links dist -U \"deepinfer\"" in err
    # and a mismatched backend never wins on priority (delta has the highest: 99)
    proc = venv.run(
        "import deepinfer._C.cuda_utils as cu; print(cu.alloc_tensor()[0])",
        DEEPINFER_PLUGINS="alpha,delta",
    )
    assert proc.stdout.strip() == "alpha", proc.stderr


def test_import_failure_is_kept_with_its_traceback(venv):
    report = venv.env_report(DEEPINFER_PLUGINS="gamma,beta")
    gamma = _backends(report)["gamma"]
    assert "Traceback (most recent call last)" in gamma["load_error"]
    assert "ImportError: gamma needs libgamma.so (fake)" in gamma["load_error"]
    err = venv.import_error("deepinfer._C.cuda_utils", DEEPINFER_PLUGINS="gamma,beta")
    assert "gamma needs libgamma.so (fake)" in err
    assert "no beta device found (fake)" in err


def test_probe_exception_is_kept_and_the_backend_skipped(venv):
    report = venv.env_report(DEEPINFER_PLUGINS="zeta,omega")
    zeta = _backends(report)["zeta"]
    assert "RuntimeError: zeta probe exploded (fake)" in zeta["probe_error"]
    assert not zeta["available"]
    assert report["selected_backend"] == "omega"


def test_plugins_variable_restricts_loading(venv, tmp_path: Path):
    counter = tmp_path / "registered.txt"
    report = venv.env_report(DEEPINFER_PLUGINS="beta", FAKE_REGISTER_COUNTER=str(counter))
    backends = _backends(report)
    assert counter.read_text().split() == ["beta"]  # no other plugin module was even imported
    assert backends["alpha"]["skipped"] and "DEEPINFER_PLUGINS='beta' excludes it" in (
        backends["alpha"]["status"]
    )


def test_no_backend_error_lists_each_probe_and_the_install_command(venv):
    err = venv.import_error("deepinfer._C.cuda_utils", DEEPINFER_PLUGINS="beta,gamma")
    assert "no accelerator backend is available" in err
    assert "deepinfer._C.engine works without one" in err
    assert "beta (entry point 'beta' from fake-backend-beta 1.2.3): unavailable: no beta device" in err
    assert 'pip install --no-index --find-links dist "deepinfer[cuda]"' in err and 'pip install --no-index --find-links dist "deepinfer[ascend]"' in err


def test_hint_when_an_accelerator_is_present_but_its_wheel_is_missing(venv, tmp_path: Path):
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "nvidiactl").touch()
    err = venv.import_error(
        "deepinfer._C.cuda_utils", DEEPINFER_PLUGINS="beta", DEEPINFER_DEVICE_ROOT=str(root)
    )
    assert "an NVIDIA GPU is present" in err
    assert 'backend wheel deepinfer-cuda is not installed: pip install --no-index --find-links dist "deepinfer[cuda]"' in err
    report = venv.env_report(DEEPINFER_PLUGINS="beta", DEEPINFER_DEVICE_ROOT=str(root))
    assert any("deepinfer-cuda is not installed" in h for h in report["hints"])


def test_probing_never_loads_and_only_the_winner_loads(venv, tmp_path: Path):
    marker = tmp_path / "loaded.txt"
    venv.env_report(FAKE_LOAD_MARKER=str(marker), DEEPINFER_PLUGINS="alpha,omega")
    assert not marker.exists()  # env probes every backend but loads none
    proc = venv.run(
        "import deepinfer._C.cuda_utils, deepinfer._C.graph_timer",
        FAKE_LOAD_MARKER=str(marker), DEEPINFER_PLUGINS="alpha,omega",
    )
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text().split() == ["alpha"]  # once, for both submodules


def test_registration_is_safe_to_repeat(venv, tmp_path: Path):
    counter = tmp_path / "registered.txt"
    code = (
        "from deepinfer.plugins.registry import registry\n"
        "first = [r.name for r in registry.discover()]\n"
        "registry.reset()\n"
        "second = [r.name for r in registry.discover()]\n"
        "assert first == second, (first, second)\n"
        "import deepinfer._C.cuda_utils as cu; print(cu.alloc_tensor()[0])\n"
    )
    proc = venv.run(code, DEEPINFER_PLUGINS="alpha", FAKE_REGISTER_COUNTER=str(counter))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "alpha"
    assert counter.read_text().split() == ["alpha", "alpha"]


def test_env_command_text_report(venv):
    proc = venv.run(
        "import sys; from deepinfer.cli import main; sys.exit(main(['env']))",
        DEEPINFER_PLUGINS="alpha,beta", DEEPINFER_BACKEND="alpha",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "Selected backend: alpha" in out
    assert "beta      fake-backend-beta 1.2.3  priority 70  plugin API 1" in out
    assert "status: unavailable: no beta device found (fake)" in out
    assert "DEEPINFER_BACKEND=alpha" in out and "DEEPINFER_PLUGINS=alpha,beta" in out
    assert "deepinfer-engine" in out and "torch" in out

"""``deepinfer env``: what is installed, what was discovered, what was selected, and why."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any

from deepinfer.plugins import hookspecs
from deepinfer.plugins.registry import (
    ENV_BACKEND,
    BackendRecord,
    BackendUnavailableError,
    accelerators_without_backend,
    registry,
)

DISTRIBUTIONS = (
    "deepinfer",
    "deepinfer-engine",
    "deepinfer-cuda",
    "deepinfer-ascend",
    "deepinfer-graph-timer",
    "torch",
    "numpy",
    "pluggy",
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _record_dict(r: BackendRecord) -> dict[str, Any]:
    desc = r.description or {}
    return {
        "entry_point": r.entry_point,
        "value": r.value,
        "name": r.name,
        "distribution": r.distribution,
        "distribution_version": r.distribution_version,
        "skipped": r.skipped,
        "priority": desc.get("priority"),
        "plugin_api_version": desc.get("plugin_api_version"),
        "load_error": r.error,
        "probe": r.probe_result,
        "probe_error": r.probe_error,
        "available": r.available and r.api_compatible and not r.error and not r.skipped,
        "status": r.why_unavailable(),
    }


def _runtime(selected: str | None) -> dict[str, str]:
    """Where deepinfer.LLM runs by default: the selected backend's torch device."""
    try:
        from deepinfer.plugins.devices import device_for_backend

        where = device_for_backend(selected)
    except ImportError as exc:  # torch missing: the runtime cannot run at all
        return {"device": "none", "backend": "none", "reason": f"the runtime cannot import: {exc}"}
    return {"device": where.device, "backend": where.backend, "reason": where.reason}


def _tensor_parallel() -> dict[str, Any] | None:
    """What ``tensor_parallel_size`` can use here: torch.distributed's backends, the CUDA devices."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available():
        return {"distributed": False, "gloo": False, "nccl": False, "cuda_devices": 0}
    return {"distributed": True, "gloo": bool(dist.is_gloo_available()), "nccl": bool(dist.is_nccl_available()),
            "cuda_devices": int(torch.cuda.device_count()) if torch.cuda.is_available() else 0}


def _cpu_kernels() -> dict[str, Any] | None:
    """The native CPU decode kernels of the engine wheel: instruction sets and, per GGUF weight
    type, the kernel table that runs it (None when the wheel has no ``_cpu_kernels``)."""
    try:
        from deepinfer_engine import _cpu_kernels as ck
    except ImportError:
        return None
    return {"best_isa": ck.best_isa(), "available_isas": list(ck.available_isas()),
            "weight_kernels": dict(ck.weight_kernels())}


def collect() -> dict[str, Any]:
    """Everything ``deepinfer env`` reports, as plain data (``--json`` prints it)."""
    records = registry.discover()
    try:
        selected: str | None = registry.resolve().name
        selection_error = None
    except BackendUnavailableError as exc:
        # (the error's own pointer to this report is no news inside it)
        selected, selection_error = None, str(exc).replace(" Run `deepinfer env` for the full report.", "")
    return {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "packages": {d: _version(d) for d in DISTRIBUTIONS},
        "plugin_api_version": hookspecs.PLUGIN_API_VERSION,
        "entry_point_group": hookspecs.ENTRY_POINT_GROUP,
        "backends": [_record_dict(r) for r in records],
        "selected_backend": selected,
        "selection_error": selection_error,
        "runtime": _runtime(selected),
        "tensor_parallel": _tensor_parallel(),
        "cpu_kernels": _cpu_kernels(),
        "hints": accelerators_without_backend(records),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DEEPINFER_")},
    }


def render(report: dict[str, Any]) -> str:
    """The human-readable report."""
    out = ["DeepInfer environment", ""]
    out.append(f"Python           {report['python']} ({report['python_executable']})")
    out.append(f"Platform         {report['platform']}")
    out.append(f"Plugin API       {report['plugin_api_version']}")
    out += ["", "Packages"]
    for dist, ver in report["packages"].items():
        out.append(f"  {dist:<24}{ver or 'not installed'}")
    out += ["", f"Backends (entry points in {report['entry_point_group']!r})"]
    if not report["backends"]:
        out.append("  none installed")
    for b in report["backends"]:
        dist = f"{b['distribution']} {b['distribution_version']}" if b["distribution"] else "?"
        extra = ""
        if b["priority"] is not None:
            extra = f"  priority {b['priority']}  plugin API {b['plugin_api_version']}"
        out.append(f"  {b['name']:<10}{dist}{extra}")
        status_lines = b["status"].splitlines()
        out.append(f"      status: {status_lines[0]}")
        out += [f"      {line}" for line in status_lines[1:]]
        for key, value in ((b["probe"] or {}).get("details") or {}).items():
            out.append(f"      {key}: {value}")
    out += ["", f"Selected backend: {report['selected_backend'] or 'none'}"]
    if report["selection_error"]:
        out += [f"  {line}" for line in report["selection_error"].splitlines()]
    rt = report.get("runtime")
    if rt:
        out.append(f"Runtime (deepinfer.LLM): device {rt['device']}, served by backend {rt['backend']} ({rt['reason']})")
    tp = report.get("tensor_parallel")
    if tp:
        if not tp["distributed"]:
            out.append("Tensor parallelism: unavailable (torch was built without torch.distributed)")
        else:
            n = tp["cuda_devices"]
            cuda = (f"up to {n} ranks ({n} devices)" if tp["nccl"] and n
                    else "no (" + ("no CUDA device" if tp["nccl"] else "torch has no NCCL") + ")")
            out.append(f"Tensor parallelism: CPU over gloo: {'yes' if tp['gloo'] else 'no'}; CUDA over NCCL: {cuda}")
    ck = report.get("cpu_kernels")
    if ck:
        kernels = ", ".join(f"{t} {isa}" for t, isa in ck["weight_kernels"].items())
        out.append(f"CPU decode kernels: {ck['best_isa']} (available: {', '.join(ck['available_isas'])}); "
                   f"per weight type: {kernels} (activations int8 per 32 for quantized types, else float32)")
    for hint in report["hints"]:
        out.append(f"Hint: {hint}")
    out += ["", "Environment variables"]
    names = sorted(set(report["environment"]) | {ENV_BACKEND, "DEEPINFER_PLUGINS", "DEEPINFER_TP_TIMEOUT_S"})
    for name in names:
        out.append(f"  {name}={report['environment'].get(name, '(unset)')}")
    return "\n".join(out)


def main(as_json: bool = False) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0

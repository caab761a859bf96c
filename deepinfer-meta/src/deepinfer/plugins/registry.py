"""Backend discovery and resolution (docs/plugins.md).

Discovery reads the entry points of group ``deepinfer.backends``; each entry point's module
is registered with a pluggy ``PluginManager`` and asked to describe itself. Failures are
kept, with their traceback, on the :class:`BackendRecord` — never swallowed — and shown by
``deepinfer env`` and in every resolution error. Probing is cheap; loading (the native
module) happens only for the backend that resolution picked.

Environment variables:

``DEEPINFER_BACKEND=name``
    force one backend; if it is unavailable, that is an error saying why and how to fix it.
``DEEPINFER_PLUGINS=a,b``
    load only these entry points (others are listed as skipped).
``DEEPINFER_DEVICE_ROOT``
    root under which device nodes are looked for when hinting at a missing backend wheel
    (default ``/``; for containers and tests).
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from deepinfer.plugins import hookspecs

ENV_BACKEND = "DEEPINFER_BACKEND"
ENV_PLUGINS = "DEEPINFER_PLUGINS"
ENV_DEVICE_ROOT = "DEEPINFER_DEVICE_ROOT"

#: Backends this project publishes: the extra that installs each, and the device nodes
#: whose presence means the accelerator is there even when its wheel is not.
KNOWN_BACKENDS: dict[str, dict[str, Any]] = {
    "cuda": {
        "distribution": "deepinfer-cuda",
        "extra": "cuda",
        "accelerator": "an NVIDIA GPU",
        "device_nodes": ("dev/nvidiactl", "dev/nvidia0", "proc/driver/nvidia/version"),
    },
    "ascend": {
        "distribution": "deepinfer-ascend",
        "extra": "ascend",
        "accelerator": "a Huawei Ascend NPU",
        "device_nodes": ("dev/davinci0", "dev/davinci_manager"),
    },
}

_REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "distribution": str,
    "version": str,
    "plugin_api_version": int,
    "priority": int,
}


class BackendUnavailableError(ImportError):
    """No backend can serve ``deepinfer._C.cuda_utils`` / ``graph_timer``; the message says why."""


@dataclass
class BackendRecord:
    """What discovery learnt about one entry point of group ``deepinfer.backends``."""

    entry_point: str
    value: str
    distribution: str | None
    distribution_version: str | None
    skipped: bool = False
    description: dict[str, Any] | None = None
    error: str | None = None  # import/registration failure, with traceback
    probe_result: dict[str, Any] | None = None
    probe_error: str | None = None  # probe raised, with traceback

    @property
    def name(self) -> str:
        return str(self.description["name"]) if self.description else self.entry_point

    @property
    def priority(self) -> int:
        return int(self.description["priority"]) if self.description else 0

    @property
    def api_compatible(self) -> bool:
        return self.description is not None and (
            self.description["plugin_api_version"] == hookspecs.PLUGIN_API_VERSION
        )

    @property
    def available(self) -> bool:
        return bool(self.probe_result and self.probe_result.get("available"))

    def why_unavailable(self) -> str:
        """One line (plus a traceback where there is one) saying why this backend cannot be used."""
        if self.skipped:
            return f"not loaded: {ENV_PLUGINS}={os.environ.get(ENV_PLUGINS, '')!r} excludes it"
        if self.error:
            return f"failed to load its plugin:\n{_indent(self.error)}"
        if not self.api_compatible:
            return _api_mismatch_message(self)
        if self.probe_error:
            return f"its probe raised:\n{_indent(self.probe_error)}"
        if not self.available:
            reason = (self.probe_result or {}).get("reason") or "probe gave no reason"
            return f"unavailable: {reason}"
        return "available"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def _meta_version() -> str:
    try:
        return metadata.version("deepinfer")
    except metadata.PackageNotFoundError:
        return "0+dev"


#: How our wheels are installed: from the folder the repository builds them into, never from the
#: package index, whose distribution named ``deepinfer`` is another project.
PIP_FROM_DIST = "pip install --no-index --find-links dist"


def install_command(requirement: str, upgrade: bool = False) -> str:
    """The pip command that installs one of our distributions from ``dist/`` only."""
    return f'{PIP_FROM_DIST}{" -U" if upgrade else ""} "{requirement}"'


def _api_mismatch_message(record: BackendRecord) -> str:
    assert record.description is not None
    theirs = record.description["plugin_api_version"]
    ours = hookspecs.PLUGIN_API_VERSION
    dist = record.description["distribution"]
    version = record.description["version"]
    if isinstance(theirs, int) and theirs > ours:
        fix = (f"{install_command('deepinfer', upgrade=True)}   "
               f"(or {install_command(f'{dist}<{version}')} to keep this deepinfer)")
    else:
        fix = install_command(dist, upgrade=True)
    return (
        f"plugin API mismatch: {dist} {version} was built for deepinfer plugin API {theirs}, "
        f"but deepinfer {_meta_version()} speaks plugin API {ours}. Fix: {fix}"
    )


def _validate_description(desc: Any) -> dict[str, Any]:
    if not isinstance(desc, dict):
        raise TypeError(f"deepinfer_backend() must return a dict, got {type(desc).__name__}")
    for key, kind in _REQUIRED_KEYS.items():
        if key not in desc:
            raise TypeError(f"deepinfer_backend() result lacks the key {key!r}")
        if not isinstance(desc[key], kind) or isinstance(desc[key], bool):
            raise TypeError(
                f"deepinfer_backend()[{key!r}] must be {getattr(kind, '__name__', kind)}, "
                f"got {desc[key]!r}"
            )
    for key in ("probe", "load"):
        if not callable(desc.get(key)):
            raise TypeError(f"deepinfer_backend()[{key!r}] must be callable")
    return desc


def _validate_probe(result: Any) -> dict[str, Any]:
    if not isinstance(result, dict) or not isinstance(result.get("available"), bool):
        raise TypeError(f"probe() must return a dict with a bool 'available', got {result!r}")
    result.setdefault("reason", "")
    result.setdefault("details", {})
    return result


def accelerators_without_backend(records: list[BackendRecord]) -> list[str]:
    """Hints for accelerators whose device nodes exist but whose backend wheel is missing."""
    root = os.environ.get(ENV_DEVICE_ROOT, "/")
    discovered = {r.entry_point for r in records} | {r.name for r in records}
    hints = []
    for name, known in KNOWN_BACKENDS.items():
        if name in discovered:
            continue
        present = [p for p in known["device_nodes"] if os.path.exists(os.path.join(root, p))]
        if present:
            hints.append(
                f"{known['accelerator']} is present ({os.path.join(root, present[0])}) but its "
                f"backend wheel {known['distribution']} is not installed: "
                + install_command("deepinfer[{}]".format(known["extra"]))
            )
    return hints


class Registry:
    """Discovers backends once, probes them once, resolves and loads at most one."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._records: list[BackendRecord] | None = None
        self._resolved: BackendRecord | None = None
        self._native: ModuleType | None = None

    # -- discovery -------------------------------------------------------------------------
    def discover(self) -> list[BackendRecord]:
        """Load, register and probe every allowed entry point (cached)."""
        with self._lock:
            if self._records is None:
                self._records = self._discover()
            return self._records

    def _discover(self) -> list[BackendRecord]:
        allowed = _allowed_plugins()
        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs)
        records = []
        eps = sorted(
            metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda ep: ep.name
        )
        for ep in eps:
            dist = getattr(ep, "dist", None)
            record = BackendRecord(
                entry_point=ep.name,
                value=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                distribution_version=dist.version if dist is not None else None,
            )
            records.append(record)
            if allowed is not None and ep.name not in allowed:
                record.skipped = True
                continue
            self._register(manager, ep, record)
            if record.description is not None:
                self._probe(record)
        return records

    @staticmethod
    def _register(manager: pluggy.PluginManager, ep: Any, record: BackendRecord) -> None:
        try:
            module = ep.load()
            manager.register(module, name=f"{ep.name}:{ep.value}")
            impls = [
                impl
                for impl in manager.hook.deepinfer_backend.get_hookimpls()
                if impl.plugin is module
            ]
            if len(impls) != 1:
                raise TypeError(
                    f"{ep.value} must implement the hook deepinfer_backend exactly once "
                    f"(found {len(impls)}); mark it with pluggy.HookimplMarker('deepinfer')"
                )
            record.description = _validate_description(impls[0].function())
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            record.error = traceback.format_exc()

    @staticmethod
    def _probe(record: BackendRecord) -> None:
        assert record.description is not None
        try:
            record.probe_result = _validate_probe(record.description["probe"]())
        except Exception:  # noqa: BLE001 — kept and reported
            record.probe_error = traceback.format_exc()

    # -- resolution ------------------------------------------------------------------------
    def resolve(self) -> BackendRecord:
        """The backend that serves ``cuda_utils``/``graph_timer``; raises BackendUnavailableError."""
        with self._lock:
            if self._resolved is None:
                self._resolved = self._resolve(self.discover())
            return self._resolved

    def _resolve(self, records: list[BackendRecord]) -> BackendRecord:
        forced = os.environ.get(ENV_BACKEND, "").strip()
        if forced:
            matches = [r for r in records if forced in (r.name, r.entry_point)]
            if not matches:
                raise BackendUnavailableError(
                    f"{ENV_BACKEND}={forced!r}, but no backend of that name is installed.\n"
                    + _listing(records)
                    + _install_hint(records, forced)
                )
            record = matches[0]
            if record.skipped or record.error or not record.api_compatible or not record.available:
                raise BackendUnavailableError(
                    f"{ENV_BACKEND}={forced!r} forces backend {record.name!r}, which cannot be "
                    f"used: {record.why_unavailable()}\n"
                    f"Fix the cause above, or unset {ENV_BACKEND} to let deepinfer choose."
                )
            return record

        usable = [
            r for r in records if not r.skipped and not r.error and r.api_compatible and r.available
        ]
        if not usable:
            raise BackendUnavailableError(
                "no accelerator backend is available for deepinfer._C.cuda_utils / "
                "deepinfer._C.graph_timer (deepinfer._C.engine works without one).\n"
                + _listing(records)
                + _install_hint(records, None)
            )
        best = max(r.priority for r in usable)
        winners = [r for r in usable if r.priority == best]
        if len(winners) > 1:
            names = ", ".join(repr(r.name) for r in winners)
            raise BackendUnavailableError(
                f"backends {names} are all available with the same priority {best}; "
                f"choose one with {ENV_BACKEND}=<name> (for example "
                f"{ENV_BACKEND}={winners[0].name}), or restrict loading with {ENV_PLUGINS}."
            )
        return winners[0]

    def load(self) -> ModuleType:
        """Load (once) and return the resolved backend's native module."""
        with self._lock:
            if self._native is None:
                record = self.resolve()
                assert record.description is not None
                try:
                    native = record.description["load"]()
                except Exception as exc:
                    raise BackendUnavailableError(
                        f"backend {record.name!r} ({record.distribution} "
                        f"{record.distribution_version}) was selected but failed to load: {exc}"
                    ) from exc
                self._native = native
            return self._native

    def reset(self) -> None:
        """Forget everything (tests, or after changing DEEPINFER_* in-process)."""
        with self._lock:
            self._records = None
            self._resolved = None
            self._native = None


def _allowed_plugins() -> set[str] | None:
    raw = os.environ.get(ENV_PLUGINS)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _listing(records: list[BackendRecord]) -> str:
    if not records:
        return (
            f"No backend plugin is installed (no entry point in group "
            f"{hookspecs.ENTRY_POINT_GROUP!r}).\n"
        )
    lines = ["Backends probed:"]
    for r in records:
        dist = f"{r.distribution} {r.distribution_version}" if r.distribution else "unknown dist"
        lines.append(f"  - {r.name} (entry point {r.entry_point!r} from {dist}): {r.why_unavailable()}")
    return "\n".join(lines) + "\n"


def _install_hint(records: list[BackendRecord], name: str | None) -> str:
    hints = accelerators_without_backend(records)
    lines = [f"Hint: {h}" for h in hints]
    if name in KNOWN_BACKENDS:
        extra = KNOWN_BACKENDS[name]["extra"]
        lines.append("To install it: " + install_command(f"deepinfer[{extra}]"))
    elif not hints:
        lines.append(
            f"To install a backend: {install_command('deepinfer[cuda]')} (NVIDIA) or "
            f"{install_command('deepinfer[ascend]')} (Huawei Ascend), with the wheels built "
            "into dist/ (docs/guide/01-install.md; the package index's 'deepinfer' is another "
            "project). Run `deepinfer env` for the full report."
        )
    return "\n".join(lines)


#: The process-wide registry behind ``deepinfer._C``.
registry = Registry()


def load_backend_submodule(name: str) -> ModuleType:
    """``cuda_utils`` or ``graph_timer`` of the resolved backend (facade modules call this)."""
    native = registry.load()
    sub = getattr(native, name, None)
    if sub is None:
        resolved = registry.resolve()
        raise BackendUnavailableError(
            f"backend {resolved.name!r} loaded, but its native module has no submodule {name!r}; "
            f"reinstall {resolved.distribution}"
        )
    return sub  # type: ignore[no-any-return]

"""The backend plugin contract: every hook a backend wheel may implement.

A backend wheel declares one entry point in the group ``deepinfer.backends``
(``cuda = "deepinfer_cuda.plugin"``) whose module holds hook implementations made
with ``pluggy.HookimplMarker("deepinfer")``. The backend never imports this package.

Registration is cheap and safe to repeat: ``deepinfer_backend`` only *describes* the
backend. Probing must not initialise heavy state (no device context, no torch import);
loading happens once, after resolution picked the backend.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "deepinfer"
ENTRY_POINT_GROUP = "deepinfer.backends"

#: The plugin API this meta package speaks. A backend built for another version is
#: refused at resolution with a message naming both versions and the pip command.
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def deepinfer_backend() -> dict[str, Any]:  # type: ignore[empty-body]
    """Describe one backend. Return a dict with exactly these keys:

    ``name`` (str)
        The backend's name, as ``DEEPINFER_BACKEND`` selects it (``"cuda"``).
    ``distribution`` (str)
        The wheel that ships it (``"deepinfer-cuda"``), for install hints.
    ``version`` (str)
        The backend wheel's version.
    ``plugin_api_version`` (int)
        The plugin API the backend was built for (compare :data:`PLUGIN_API_VERSION`).
    ``priority`` (int)
        Higher wins when several backends are available.
    ``probe`` (``() -> dict``)
        Cheap availability check, no heavy initialisation. Returns
        ``{"available": bool, "reason": str, "details": dict[str, str]}``; ``reason``
        says why it is unavailable (empty when available) and ``details`` carries
        facts for ``deepinfer env`` (driver version, device count, library path...).
    ``load`` (``() -> module``)
        Import and return the native module; it has attributes ``cuda_utils`` and
        ``graph_timer`` (submodules with the same Python signatures on every backend).
    """

"""``deepinfer serve``: an OpenAI-compatible HTTP server over the engine (extra ``deepinfer[serve]``).

``build_app(llm, ServeConfig(...))`` returns the ASGI app; ``deepinfer serve`` (``cli.py``) runs
it with uvicorn. Importing this package is cheap; ``build_app`` needs FastAPI and
prometheus-client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServeConfig", "build_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from deepinfer.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'deepinfer.serve' has no attribute {name!r}")

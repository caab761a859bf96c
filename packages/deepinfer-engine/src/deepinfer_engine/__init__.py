"""DeepInfer's C++ engine core. Users import it as ``deepinfer._C.engine``."""

from importlib.metadata import PackageNotFoundError, version

from deepinfer_engine import _engine  # type: ignore[attr-defined]  # native; stub: deepinfer/_C/engine.pyi

try:
    __version__ = version("deepinfer-engine")
except PackageNotFoundError:  # a developer build on PYTHONPATH (scripts/devbuild.sh)
    __version__ = "0+dev"

__all__ = ["__version__", "_engine"]

"""Cheap availability check of the CUDA driver, with ctypes.

Loads ``libcuda.so.1`` and calls ``cuInit``, ``cuDriverGetVersion`` and
``cuDeviceGetCount``: no context is created and torch is not imported. Each way of
failing has its own reason, which ``deepinfer env`` and the registry's errors show.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

LIBRARY = "libcuda.so.1"


def _error_name(lib: ctypes.CDLL, code: int) -> str:
    name = ctypes.c_char_p()
    try:
        if lib.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
    except AttributeError:
        pass
    return "CUDA_ERROR_UNKNOWN"


def _loaded_path() -> str:
    """Where the dynamic loader found libcuda (from /proc/self/maps), or the soname."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                if "libcuda.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return LIBRARY


def probe() -> dict[str, Any]:
    """``{"available": bool, "reason": str, "details": dict[str, str]}`` for the registry."""
    details: dict[str, str] = {"library": LIBRARY}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        details["CUDA_VISIBLE_DEVICES"] = visible

    def unavailable(reason: str) -> dict[str, Any]:
        return {"available": False, "reason": reason, "details": details}

    try:
        lib = ctypes.CDLL(LIBRARY)
    except OSError as exc:
        details["error"] = str(exc)
        return unavailable(f"{LIBRARY} not found: no NVIDIA driver installed")
    details["library"] = _loaded_path()

    rc = lib.cuInit(0)
    if rc != 0:
        return unavailable(f"cuInit failed with {_error_name(lib, rc)} ({rc})")

    version = ctypes.c_int()
    rc = lib.cuDriverGetVersion(ctypes.byref(version))
    if rc != 0:
        return unavailable(f"cuDriverGetVersion failed with {_error_name(lib, rc)} ({rc})")
    details["driver_version"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    if version.value < 12000:
        return unavailable(
            f"the NVIDIA driver supports CUDA {details['driver_version']}; deepinfer-cuda needs CUDA 12.0 or newer"
        )

    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return unavailable(f"cuDeviceGetCount failed with {_error_name(lib, rc)} ({rc})")
    details["device_count"] = str(count.value)
    if count.value == 0:
        return unavailable("the NVIDIA driver sees no CUDA device (check CUDA_VISIBLE_DEVICES)")
    return {"available": True, "reason": "", "details": details}

"""The cheap availability check of the Ascend backend (no aclInit, no device context)."""

from __future__ import annotations

import ctypes
from typing import Any

from deepinfer_ascend._library import find_library

_ACL_PKG_NAME_CANN = 0


class _CANNPackageVersion(ctypes.Structure):
    # aclCANNPackageVersion from acl/acl_rt.h: version[128], four parts of 64, reserved[128].
    _fields_ = [
        ("version", ctypes.c_char * 128),
        ("major", ctypes.c_char * 64),
        ("minor", ctypes.c_char * 64),
        ("release", ctypes.c_char * 64),
        ("patch", ctypes.c_char * 64),
        ("reserved", ctypes.c_char * 128),
    ]


def _unavailable(reason: str, details: dict[str, str]) -> dict[str, Any]:
    return {"available": False, "reason": reason, "details": details}


def _cann_version(lib: ctypes.CDLL) -> tuple[str | None, str]:
    """(version, "") or (None, reason). Prefers the CANN package version, else the ACL API version."""
    if hasattr(lib, "aclsysGetCANNVersion"):
        ver = _CANNPackageVersion()
        rc = lib.aclsysGetCANNVersion(_ACL_PKG_NAME_CANN, ctypes.byref(ver))
        if rc != 0:
            return None, f"aclsysGetCANNVersion failed with ACL error {rc}"
        return ver.version.decode(errors="replace"), ""
    if hasattr(lib, "aclrtGetVersion"):
        major, minor, patch = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        rc = lib.aclrtGetVersion(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
        if rc != 0:
            return None, f"aclrtGetVersion failed with ACL error {rc}"
        return f"ACL API {major.value}.{minor.value}.{patch.value}", ""
    return None, "libascendcl.so exports neither aclsysGetCANNVersion nor aclrtGetVersion"


def probe() -> dict[str, Any]:
    """``{"available", "reason", "details"}`` as the deepinfer plugin contract describes."""
    found = find_library()
    details: dict[str, str] = {}
    if found.path is None:
        return _unavailable(found.reason, details)
    details["library"] = found.path
    try:
        lib = ctypes.CDLL(found.path)
    except OSError as exc:
        return _unavailable(f"libascendcl.so at {found.path} could not be loaded: {exc}", details)
    if not hasattr(lib, "aclrtGetDeviceCount"):
        return _unavailable(f"{found.path} does not export aclrtGetDeviceCount", details)
    count = ctypes.c_uint32(0)
    rc = lib.aclrtGetDeviceCount(ctypes.byref(count))
    if rc != 0:
        return _unavailable(f"aclrtGetDeviceCount failed with ACL error {rc}", details)
    details["device_count"] = str(count.value)
    if count.value == 0:
        return _unavailable(
            f"libascendcl.so loaded from {found.path} but no Ascend NPU is visible "
            "(aclrtGetDeviceCount returned 0; check the driver and ASCEND_RT_VISIBLE_DEVICES)",
            details,
        )
    version, why = _cann_version(lib)
    if version is None:
        return _unavailable(why, details)
    details["cann_version"] = version
    if hasattr(lib, "deepinfer_fake_acl_host_visible"):
        details["fake_acl"] = "yes (test library: host memory stands in for device memory)"
    return {"available": True, "reason": "", "details": details}

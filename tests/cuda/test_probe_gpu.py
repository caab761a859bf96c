"""On a GPU machine: the probe reports the driver and devices and creates no CUDA context."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from cuda_test_support import requires_gpu

pytestmark = requires_gpu


def test_probe_reports_driver_and_creates_no_context():
    code = textwrap.dedent(
        """
        import ctypes, json
        from deepinfer_cuda._probe import probe
        result = probe()
        lib = ctypes.CDLL("libcuda.so.1")
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
        ctx = ctypes.c_void_p()
        assert lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        count = ctypes.c_int()
        lib.cuDeviceGetCount(ctypes.byref(count))
        print(json.dumps({"result": result, "active": active.value, "current": ctx.value,
                          "version": version.value, "count": count.value}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["result"]["available"] is True and out["result"]["reason"] == ""
    details = out["result"]["details"]
    assert details["device_count"] == str(out["count"])
    assert details["driver_version"] == f"{out['version'] // 1000}.{out['version'] % 1000 // 10}"
    assert "libcuda.so" in details["library"]
    assert out["active"] == 0 and out["current"] is None  # no primary context, none current

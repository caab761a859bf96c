/* A stand-in libcuda.so.1 for the probe tests: each entry point answers what the
 * FAKE_CUDA_* environment variables say, so every failure path of the probe can be
 * driven on a machine without a GPU. Exports no cuGetProcAddress_v2 (a pre-CUDA-12
 * driver to the native module). */
#include <stdlib.h>

static int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v ? atoi(v) : fallback;
}

int cuInit(unsigned int flags) { (void)flags; return env_int("FAKE_CUDA_INIT_RESULT", 0); }

int cuDriverGetVersion(int* version) {
  *version = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
  return 0;
}

int cuDeviceGetCount(int* count) {
  *count = env_int("FAKE_CUDA_DEVICE_COUNT", 1);
  return env_int("FAKE_CUDA_COUNT_RESULT", 0);
}

int cuGetErrorName(int code, const char** name) {
  switch (code) {
    case 100: *name = "CUDA_ERROR_NO_DEVICE"; return 0;
    case 35: *name = "CUDA_ERROR_INSUFFICIENT_DRIVER"; return 0;
    case 3: *name = "CUDA_ERROR_NOT_INITIALIZED"; return 0;
    default: return 1;
  }
}

#include "driver.h"

#include <dlfcn.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace deepinfer_cuda {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

// The ABI every required entry point is requested at (see driver.h).
constexpr int kAbiVersion = 12000;
constexpr int kOptionalAbiVersion = 12030;

template <typename Fn>
void resolve(GetProcAddress get, const char* symbol, Fn& out, int version, bool required) {
  void* pfn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult rc = get(symbol, &pfn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  if (rc != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS || pfn == nullptr) {
    if (required) {
      throw std::runtime_error(std::string("the CUDA driver does not provide ") + symbol +
                               " at the CUDA 12.0 ABI; deepinfer-cuda needs a CUDA 12 or newer driver");
    }
    out = nullptr;
    return;
  }
  out = reinterpret_cast<Fn>(pfn);
}

DriverApi load_driver() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(std::string("libcuda.so.1 not found: no NVIDIA driver installed (") +
                             (why ? why : "dlopen failed") + ")");
  }
  auto get = reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get == nullptr) {
    throw std::runtime_error(
        "libcuda.so.1 has no cuGetProcAddress_v2: the NVIDIA driver is older than CUDA 12; "
        "install a CUDA 12 or newer driver");
  }
  DriverApi api{};
#define DEEPINFER_RESOLVE(name) resolve(get, #name, api.name, kAbiVersion, true)
  DEEPINFER_RESOLVE(cuInit);
  DEEPINFER_RESOLVE(cuDriverGetVersion);
  DEEPINFER_RESOLVE(cuGetErrorName);
  DEEPINFER_RESOLVE(cuGetErrorString);
  DEEPINFER_RESOLVE(cuDeviceGetCount);
  DEEPINFER_RESOLVE(cuDeviceGet);
  DEEPINFER_RESOLVE(cuDeviceGetUuid);
  DEEPINFER_RESOLVE(cuDevicePrimaryCtxRetain);
  DEEPINFER_RESOLVE(cuCtxPushCurrent);
  DEEPINFER_RESOLVE(cuCtxPopCurrent);
  DEEPINFER_RESOLVE(cuCtxGetCurrent);
  DEEPINFER_RESOLVE(cuCtxGetDevice);
  DEEPINFER_RESOLVE(cuMemAlloc);
  DEEPINFER_RESOLVE(cuMemFree);
  DEEPINFER_RESOLVE(cuMemGetInfo);
  DEEPINFER_RESOLVE(cuMemGetAddressRange);
  DEEPINFER_RESOLVE(cuPointerGetAttribute);
  DEEPINFER_RESOLVE(cuIpcGetMemHandle);
  DEEPINFER_RESOLVE(cuIpcOpenMemHandle);
  DEEPINFER_RESOLVE(cuIpcCloseMemHandle);
  DEEPINFER_RESOLVE(cuEventCreate);
  DEEPINFER_RESOLVE(cuEventDestroy);
  DEEPINFER_RESOLVE(cuEventRecord);
  DEEPINFER_RESOLVE(cuEventRecordWithFlags);
  DEEPINFER_RESOLVE(cuEventQuery);
  DEEPINFER_RESOLVE(cuEventSynchronize);
  DEEPINFER_RESOLVE(cuEventElapsedTime);
  DEEPINFER_RESOLVE(cuStreamIsCapturing);
  DEEPINFER_RESOLVE(cuStreamGetCtx);
  DEEPINFER_RESOLVE(cuGraphGetNodes);
  DEEPINFER_RESOLVE(cuGraphGetEdges);
  DEEPINFER_RESOLVE(cuGraphNodeGetType);
  DEEPINFER_RESOLVE(cuGraphNodeGetDependencies);
  DEEPINFER_RESOLVE(cuGraphNodeGetDependentNodes);
  DEEPINFER_RESOLVE(cuGraphAddEventRecordNode);
  DEEPINFER_RESOLVE(cuGraphAddDependencies);
  DEEPINFER_RESOLVE(cuGraphRemoveDependencies);
  DEEPINFER_RESOLVE(cuGraphDestroyNode);
  DEEPINFER_RESOLVE(cuGraphEventRecordNodeGetEvent);
  DEEPINFER_RESOLVE(cuGraphExecEventRecordNodeSetEvent);
  DEEPINFER_RESOLVE(cuGraphKernelNodeGetParams);
  DEEPINFER_RESOLVE(cuGraphInstantiateWithFlags);
  DEEPINFER_RESOLVE(cuGraphExecDestroy);
  DEEPINFER_RESOLVE(cuGraphLaunch);
#undef DEEPINFER_RESOLVE
  resolve(get, "cuGraphGetEdges", api.cuGraphGetEdgesWithData, kOptionalAbiVersion, false);
  resolve(get, "cuGraphNodeGetDependencies", api.cuGraphNodeGetDependenciesWithData, kOptionalAbiVersion, false);
  resolve(get, "cuGraphNodeGetDependentNodes", api.cuGraphNodeGetDependentNodesWithData, kOptionalAbiVersion,
          false);
  resolve(get, "cuGraphAddDependencies", api.cuGraphAddDependenciesWithData, kOptionalAbiVersion, false);
  resolve(get, "cuGraphRemoveDependencies", api.cuGraphRemoveDependenciesWithData, kOptionalAbiVersion, false);
  resolve(get, "cuFuncGetName", api.cuFuncGetName, kOptionalAbiVersion, false);
  resolve(get, "cuKernelGetName", api.cuKernelGetName, kOptionalAbiVersion, false);

  CUresult rc = api.cuInit(0);
  if (rc != CUDA_SUCCESS) {
    const char* name = nullptr;
    api.cuGetErrorName(rc, &name);
    throw CudaError(rc, std::string("cuInit failed with ") + (name ? name : "an unknown error") + " (" +
                            std::to_string(static_cast<int>(rc)) + ")");
  }
  return api;
}

struct PrimaryContexts {
  std::mutex mutex;
  std::vector<CUcontext> contexts;
};

PrimaryContexts& primary_contexts() {
  static PrimaryContexts* state = new PrimaryContexts();  // leaked: used until process exit
  return *state;
}

}  // namespace

const DriverApi& driver() {
  // A failed load is retried on the next call (and reported again) instead of cached.
  static std::mutex mutex;
  static DriverApi* api = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (api == nullptr) api = new DriverApi(load_driver());
  return *api;
}

std::string describe(CUresult code) {
  const DriverApi& api = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  api.cuGetErrorName(code, &name);
  api.cuGetErrorString(code, &text);
  return std::string(name ? name : "CUDA_ERROR_UNKNOWN") + " (" + std::to_string(static_cast<int>(code)) +
         "): " + (text ? text : "unknown error");
}

void check(CUresult code, const char* call) {
  if (code != CUDA_SUCCESS) throw CudaError(code, std::string(call) + " failed: " + describe(code));
}

int device_count() {
  int count = 0;
  check(driver().cuDeviceGetCount(&count), "cuDeviceGetCount");
  return count;
}

void validate_device(int device, const char* argument) {
  int count = device_count();
  if (device < 0 || device >= count) {
    throw std::invalid_argument(std::string(argument) + "=" + std::to_string(device) +
                                " is not a visible CUDA device (this process sees " + std::to_string(count) +
                                " device(s): 0.." + std::to_string(count - 1) + ")");
  }
}

CUcontext primary_context(int device) {
  validate_device(device, "device");
  PrimaryContexts& state = primary_contexts();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.contexts.size() <= static_cast<size_t>(device)) state.contexts.resize(device + 1, nullptr);
  if (state.contexts[device] == nullptr) {
    CUdevice dev = 0;
    check(driver().cuDeviceGet(&dev, device), "cuDeviceGet");
    CUcontext ctx = nullptr;
    check(driver().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    state.contexts[device] = ctx;
  }
  return state.contexts[device];
}

int current_device_or_none() {
  CUcontext ctx = nullptr;
  if (driver().cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr) return -1;
  CUdevice dev = 0;
  if (driver().cuCtxGetDevice(&dev) != CUDA_SUCCESS) return -1;
  return static_cast<int>(dev);
}

ContextScope::ContextScope(int device) { push(primary_context(device)); }

ContextScope::ContextScope(CUcontext context) { push(context); }

void ContextScope::push(CUcontext context) {
  check(driver().cuCtxPushCurrent(context), "cuCtxPushCurrent");
  pushed_ = true;
}

ContextScope::~ContextScope() {
  if (pushed_) {
    CUcontext popped = nullptr;
    driver().cuCtxPopCurrent(&popped);
  }
}

}  // namespace deepinfer_cuda

#include "acl_api.h"

#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <mutex>

namespace py = pybind11;

namespace deepinfer_ascend {

AclError::AclError(std::string call, int code, const std::string& what)
    : std::runtime_error(what), call_(std::move(call)), code_(code) {}

namespace {

std::mutex g_load_mutex;
std::unique_ptr<AclApi> g_api;
std::atomic<const AclApi*> g_api_ptr{nullptr};

// Asks Python where the library is. Runs without g_load_mutex held: the import may release
// the GIL, and a thread waiting on the mutex with the GIL would deadlock us.
std::string library_path() {
  py::gil_scoped_acquire gil;
  try {
    return py::module_::import("deepinfer_ascend._library").attr("library_path")().cast<std::string>();
  } catch (py::error_already_set& e) {
    throw std::runtime_error("deepinfer-ascend cannot use AscendCL: " + py::str(e.value()).cast<std::string>());
  }
}

std::unique_ptr<AclApi> load_library(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    throw std::runtime_error("deepinfer-ascend cannot dlopen " + path + ": " + (err ? err : "unknown error"));
  }
  auto api = std::make_unique<AclApi>();
  api->path = path;
#define DEEPINFER_ACL_RESOLVE(name) api->name = reinterpret_cast<decltype(&::name)>(dlsym(handle, #name));
  DEEPINFER_ACL_FUNCTIONS(DEEPINFER_ACL_RESOLVE)
#undef DEEPINFER_ACL_RESOLVE
  api->host_visible = dlsym(handle, "deepinfer_fake_acl_host_visible") != nullptr;
  // The handle stays open for the life of the process: memory and events outlive any scope.
  return api;
}

}  // namespace

const AclApi& acl() {
  if (const AclApi* api = g_api_ptr.load(std::memory_order_acquire)) return *api;
  const std::string path = library_path();
  std::lock_guard<std::mutex> lock(g_load_mutex);
  if (!g_api) {
    g_api = load_library(path);
    g_api_ptr.store(g_api.get(), std::memory_order_release);
  }
  return *g_api;
}

void check(aclError rc, const char* call) {
  if (rc == ACL_SUCCESS) return;
  throw AclError(call, rc, std::string(call) + " failed with ACL error " + std::to_string(rc));
}

void use_device(int device) {
  static std::mutex init_mutex;
  static bool initialized = false;
  const AclApi& api = acl();
  {
    std::lock_guard<std::mutex> lock(init_mutex);
    if (!initialized) {  // a failed aclInit is retried by the next call
      aclError rc = require(api.aclInit, "aclInit")(nullptr);
      if (rc == ACL_ERROR_REPEAT_INITIALIZE) rc = ACL_SUCCESS;  // torch_npu got there first
      check(rc, "aclInit");
      initialized = true;
    }
  }
  ACL_CHECKED(aclrtSetDevice, device);
}

int current_device() {
  const AclApi& api = acl();
  int32_t device = 0;
  if (api.aclrtGetDevice == nullptr || api.aclrtGetDevice(&device) != ACL_SUCCESS) return 0;
  return device;
}

int device_count() {
  uint32_t count = 0;
  ACL_CHECKED(aclrtGetDeviceCount, &count);
  return static_cast<int>(count);
}

}  // namespace deepinfer_ascend

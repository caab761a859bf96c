// AscendCL resolved at run time: function pointers from dlopen("libascendcl.so"), the error
// type every failed ACL call becomes, and the per-thread device setup the calls need.
#pragma once

#include <acl/acl_base.h>
#include <acl/acl_rt.h>

#include <stdexcept>
#include <string>

namespace deepinfer_ascend {

// An ACL call returned a non-zero aclError. Python sees deepinfer_ascend._native.AclError
// (a RuntimeError) with attributes `call` and `code`.
class AclError : public std::runtime_error {
 public:
  AclError(std::string call, int code, const std::string& what);
  const std::string& call() const { return call_; }
  int code() const { return code_; }

 private:
  std::string call_;
  int code_;
};

// Something the loaded ACL cannot do (a missing symbol, or an ACL limit). Python sees
// NotImplementedError.
class AclUnsupported : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

#define DEEPINFER_ACL_FUNCTIONS(X)                                                        \
  X(aclInit) X(aclrtGetDeviceCount) X(aclrtSetDevice) X(aclrtGetDevice) X(aclrtMalloc) X(aclrtFree)         \
  X(aclrtCreateEventWithFlag) X(aclrtDestroyEvent) X(aclrtRecordEvent)                    \
  X(aclrtQueryEventStatus) X(aclrtSynchronizeEvent) X(aclrtEventElapsedTime)              \
  X(aclrtIpcMemGetExportKey) X(aclrtIpcMemSetImportPid) X(aclrtIpcMemImportByKey)         \
  X(aclrtIpcMemClose) X(aclmdlRICaptureBegin) X(aclmdlRICaptureGetInfo)                   \
  X(aclmdlRICaptureEnd) X(aclmdlRIExecuteAsync) X(aclmdlRIDestroy) X(aclmdlRIGetStreams)  \
  X(aclmdlRIGetTasksByStream) X(aclmdlRITaskGetType) X(aclmdlRITaskGetParams)             \
  X(aclmdlRITaskSetParams) X(aclmdlRIUpdate)

// Entry points of the loaded library; a symbol the library lacks is nullptr and using it
// raises AclUnsupported naming it (older CANN releases lack the aclmdlRI inspection calls).
struct AclApi {
#define DEEPINFER_ACL_MEMBER(name) decltype(&::name) name = nullptr;
  DEEPINFER_ACL_FUNCTIONS(DEEPINFER_ACL_MEMBER)
#undef DEEPINFER_ACL_MEMBER
  std::string path;
  // Test seam: the fake library of tests/ascend exports deepinfer_fake_acl_host_visible;
  // its "device" memory is host memory, handed to torch as CPU DLPack tensors.
  bool host_visible = false;
};

// The loaded library. First use (GIL held) asks deepinfer_ascend._library for the path and
// dlopens it; failure raises RuntimeError with the search's reason.
const AclApi& acl();

// Throws AclError when rc != ACL_SUCCESS.
void check(aclError rc, const char* call);

// Throws AclUnsupported when the library lacks `fn`.
template <typename F>
F require(F fn, const char* name) {
  if (fn == nullptr) {
    throw AclUnsupported(std::string("the loaded libascendcl.so (") + acl().path + ") has no " + name +
                         "; this needs a newer CANN release");
  }
  return fn;
}

#define ACL_CHECKED(name, ...) ::deepinfer_ascend::check(::deepinfer_ascend::require(::deepinfer_ascend::acl().name, #name)(__VA_ARGS__), #name)

// aclInit once per process, then aclrtSetDevice(device) for the calling thread.
void use_device(int device);

// aclrtGetDeviceCount.
int device_count();

// The device set on this thread (aclrtGetDevice), or 0 when none is.
int current_device();

}  // namespace deepinfer_ascend

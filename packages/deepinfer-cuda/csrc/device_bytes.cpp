#include "device_bytes.h"

#include <Python.h>

#include <memory>
#include <utility>

#include "dlpack_abi.h"

namespace deepinfer_cuda {
namespace {

struct Holder {
  dlpack::ManagedTensor managed{};
  int64_t shape[1] = {0};
  ReleaseFn release;
};

void delete_holder(dlpack::ManagedTensor* self) {
  auto* holder = static_cast<Holder*>(self->manager_ctx);
  if (holder->release) holder->release();
  delete holder;
}

// Capsule destructor: frees the memory only if no consumer took ownership (a consumer
// renames the capsule to "used_dltensor" and calls the deleter itself).
void capsule_destructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
  }
}

}  // namespace

pybind11::capsule make_device_bytes_capsule(uintptr_t ptr, int64_t nbytes, int device, ReleaseFn release) {
  auto holder = std::make_unique<Holder>();
  holder->shape[0] = nbytes;
  holder->release = std::move(release);
  dlpack::Tensor& t = holder->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(ptr);
  t.device = {dlpack::kCUDA, device};
  t.ndim = 1;
  t.dtype = {dlpack::kUInt, 8, 1};
  t.shape = holder->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  holder->managed.manager_ctx = holder.get();
  holder->managed.deleter = delete_holder;
  PyObject* capsule = PyCapsule_New(&holder->managed, "dltensor", capsule_destructor);
  if (capsule == nullptr) {
    // The holder (and its release) stays with us: run the release before reporting.
    delete_holder(&holder.release()->managed);
    throw pybind11::error_already_set();
  }
  holder.release();
  return pybind11::reinterpret_steal<pybind11::capsule>(capsule);
}

}  // namespace deepinfer_cuda

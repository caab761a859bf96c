// Device memory owned by this module (aclrtMalloc/aclrtFree) and its hand-over to torch as a
// DLPack capsule whose deleter drops the owner.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor_args.h"

namespace deepinfer_ascend {

// One aclrtMalloc. Freed (after closing its IPC export key, so importers' keys are never
// left dangling inside ACL) when the last tensor over it dies.
class Allocation {
 public:
  Allocation(std::size_t bytes, int device);  // bytes == 0: no device memory, ptr() == nullptr
  ~Allocation();
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;

  void* ptr() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  int device() const { return device_; }

  // The allocation's IPC export key, created on first use (see ipc.cpp).
  std::mutex& mutex() { return mutex_; }
  std::string& export_key() { return export_key_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_;
  int device_;
  std::mutex mutex_;
  std::string export_key_;
};

// aclrtMalloc on `device` (after aclInit/aclrtSetDevice), registered for IPC look-ups.
std::shared_ptr<Allocation> make_allocation(std::size_t bytes, int device);

// The live allocation of this process whose range holds `address`, or nullptr.
std::shared_ptr<Allocation> find_allocation(std::uintptr_t address);

// The live allocation of this process with this export key, or nullptr.
std::shared_ptr<Allocation> find_allocation_by_key(const std::string& key);

// A torch tensor over `data` (device memory on `device`), keeping `owner` alive until torch
// frees the tensor's storage. Built from a DLPack capsule: kDLExtDev (torch's PrivateUse1,
// i.e. torch_npu's "npu"), or kDLCPU when the loaded library is the host-memory test fake.
pybind11::object to_torch(std::shared_ptr<void> owner, void* data, int device, const DType& dtype,
                          const std::vector<int64_t>& shape, const std::vector<int64_t>& strides);

// The tensor's device type and index as torch reports them; TypeError (naming `arg`) when
// `tensor` is not a torch.Tensor; ValueError when it is not on an NPU (or, with the fake,
// on the CPU).
int tensor_device(pybind11::handle tensor, const char* arg);

}  // namespace deepinfer_ascend

#include "device_memory.h"

#include <cstdio>
#include <map>

#include "acl_api.h"

namespace py = pybind11;

namespace deepinfer_ascend {

namespace {

std::mutex g_registry_mutex;
std::map<std::uintptr_t, std::weak_ptr<Allocation>> g_registry;  // by base address

// What a DLPack consumer holds: the owner plus the shape/strides arrays DLTensor points to.
struct DLPackHolder {
  std::shared_ptr<void> owner;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLManagedTensor managed{};
};

void dlpack_deleter(DLManagedTensor* self) { delete static_cast<DLPackHolder*>(self->manager_ctx); }

// A capsule torch never consumed still owns its tensor.
void capsule_destructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
  } else {
    PyErr_Clear();
  }
}

}  // namespace

Allocation::Allocation(std::size_t bytes, int device) : bytes_(bytes), device_(device) {
  if (bytes == 0) return;
  use_device(device);
  ACL_CHECKED(aclrtMalloc, &ptr_, bytes, ACL_MEM_MALLOC_HUGE_FIRST);
}

Allocation::~Allocation() {
  if (ptr_ == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = g_registry.find(reinterpret_cast<std::uintptr_t>(ptr_));
    if (it != g_registry.end() && it->second.expired()) g_registry.erase(it);
  }
  // Runs from torch's storage deleter, possibly on any thread and without the GIL: no
  // Python here, and no exception may escape. Failures are reported on stderr.
  try {
    use_device(device_);
    if (!export_key_.empty()) check(acl().aclrtIpcMemClose(export_key_.c_str()), "aclrtIpcMemClose");
    check(acl().aclrtFree(ptr_), "aclrtFree");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deepinfer-ascend: freeing device memory %p failed: %s\n", ptr_, e.what());
  }
}

std::shared_ptr<Allocation> make_allocation(std::size_t bytes, int device) {
  auto alloc = std::make_shared<Allocation>(bytes, device);
  if (alloc->ptr() != nullptr) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_registry[reinterpret_cast<std::uintptr_t>(alloc->ptr())] = alloc;
  }
  return alloc;
}

// The shared_ptrs taken under g_registry_mutex are released after it: if one is the last
// owner, ~Allocation (which takes the mutex) runs outside it.
std::shared_ptr<Allocation> find_allocation(std::uintptr_t address) {
  std::shared_ptr<Allocation> alloc;
  std::uintptr_t base = 0;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = g_registry.upper_bound(address);
    if (it == g_registry.begin()) return nullptr;
    --it;
    base = it->first;
    alloc = it->second.lock();
  }
  if (!alloc || address >= base + alloc->bytes()) return nullptr;
  return alloc;
}

std::shared_ptr<Allocation> find_allocation_by_key(const std::string& key) {
  std::vector<std::shared_ptr<Allocation>> live;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    for (auto& [base, weak] : g_registry)
      if (auto alloc = weak.lock()) live.push_back(std::move(alloc));
  }
  for (auto& alloc : live) {
    std::lock_guard<std::mutex> key_lock(alloc->mutex());
    if (alloc->export_key() == key) return alloc;
  }
  return nullptr;
}

py::object to_torch(std::shared_ptr<void> owner, void* data, int device, const DType& dtype,
                    const std::vector<int64_t>& shape, const std::vector<int64_t>& strides) {
  const bool host = acl().host_visible;
  if (!host) py::module_::import("torch_npu");  // registers "npu" as torch's PrivateUse1 device
  auto* holder = new DLPackHolder{std::move(owner), shape, strides, {}};
  DLTensor& t = holder->managed.dl_tensor;
  t.data = data;
  t.device = host ? DLDevice{kDLCPU, 0} : DLDevice{kDLExtDev, device};
  t.ndim = static_cast<int>(holder->shape.size());
  t.dtype = dtype.dl;
  t.shape = holder->shape.data();
  t.strides = holder->strides.data();
  t.byte_offset = 0;
  holder->managed.manager_ctx = holder;
  holder->managed.deleter = dlpack_deleter;
  PyObject* raw = PyCapsule_New(&holder->managed, "dltensor", capsule_destructor);
  if (raw == nullptr) {
    delete holder;
    throw py::error_already_set();
  }
  py::object capsule = py::reinterpret_steal<py::object>(raw);
  return py::module_::import("torch.utils.dlpack").attr("from_dlpack")(capsule);
}

int tensor_device(py::handle tensor, const char* arg) {
  py::module_ torch = py::module_::import("torch");
  if (!py::isinstance(tensor, torch.attr("Tensor"))) {
    throw py::type_error(std::string(arg) + " must be a torch.Tensor, got " + py_repr(py::type::handle_of(tensor)));
  }
  py::object dev = tensor.attr("device");
  const std::string type = py::str(dev.attr("type")).cast<std::string>();
  const bool host = acl().host_visible;
  if (type != "npu" && !(host && type == "cpu")) {
    throw py::value_error(std::string(arg) + " is on " + py_repr(dev) + "; deepinfer-ascend shares NPU tensors only");
  }
  py::object idx = dev.attr("index");
  return (host || idx.is_none()) ? -1 : idx.cast<int>();
}

}  // namespace deepinfer_ascend

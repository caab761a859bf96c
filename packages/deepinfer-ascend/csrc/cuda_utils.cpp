// deepinfer_ascend._native.cuda_utils: alloc_tensor, export_ipc_tensor, import_ipc_tensor on ACL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <optional>

#include "acl_api.h"
#include "stub_types.h"
#include "device_memory.h"
#include "tensor_args.h"

namespace py = pybind11;

namespace deepinfer_ascend {

namespace {

// ACL IPC keys are NUL-terminated strings of at most 64 characters.
constexpr std::size_t kIpcKeyBytes = 65;

// ACL's IPC export/import refuses memory that is not page-aligned, and aclrtMalloc may carve
// small requests out of a larger block. Whole pages (4 KiB; 2 MiB huge pages from 2 MiB on)
// keep every allocation shareable.
std::size_t page_rounded(std::size_t bytes) {
  constexpr std::size_t kPage = 4096, kHugePage = 2u << 20;
  const std::size_t unit = bytes >= kHugePage ? kHugePage : kPage;
  return bytes == 0 ? 0 : (bytes + unit - 1) / unit * unit;
}

TensorObj alloc_tensor(ShapeObj shape_arg, DTypeObj dtype_arg, DeviceObj device_arg) {
  const std::vector<int64_t> shape = parse_shape(shape_arg, "shape");
  const DType dtype = parse_dtype(dtype_arg, "dtype");
  const int device = parse_device(device_arg, "device");
  const std::size_t bytes = checked_numel(shape, dtype.itemsize, "shape") * dtype.itemsize;
  std::shared_ptr<Allocation> alloc = make_allocation(page_rounded(bytes), device);
  void* data = alloc->ptr();
  return to_torch(std::move(alloc), data, device, dtype, shape, contiguous_strides(shape));
}

// Bytes spanned by a strided view (0 for an empty one).
std::size_t view_extent(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides, std::size_t itemsize) {
  std::size_t last = 0;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += static_cast<std::size_t>(shape[i] - 1) * static_cast<std::size_t>(strides[i]);
  }
  return (last + 1) * itemsize;
}

HandleObj export_ipc_tensor(TensorObj tensor, std::optional<std::vector<int32_t>> importer_pids) {
  tensor_device(tensor, "tensor");
  const DType dtype = parse_dtype(tensor.attr("dtype"), "tensor.dtype");
  const auto shape = tensor.attr("shape").cast<std::vector<int64_t>>();
  const auto strides = tensor.attr("stride")().cast<std::vector<int64_t>>();
  for (int64_t s : strides)
    if (s < 0) throw py::value_error("tensor has a negative stride; export a contiguous copy instead");
  const auto address = tensor.attr("data_ptr")().cast<std::uintptr_t>();
  const std::size_t extent = view_extent(shape, strides, dtype.itemsize);
  if (extent == 0) throw py::value_error("tensor is empty (numel() == 0): there is no memory to share");
  std::shared_ptr<Allocation> alloc = find_allocation(address);
  if (!alloc) {
    throw py::value_error(
        "tensor (data_ptr=" + std::to_string(address) +
        ") is not memory from deepinfer_ascend alloc_tensor: ACL export keys must be closed before the memory is "
        "freed, which deepinfer can only guarantee for its own allocations");
  }
  const std::size_t offset = address - reinterpret_cast<std::uintptr_t>(alloc->ptr());
  if (offset + extent > alloc->bytes()) throw py::value_error("tensor's view runs past the end of its allocation");
  {
    std::lock_guard<std::mutex> lock(alloc->mutex());
    use_device(alloc->device());
    if (alloc->export_key().empty()) {
      // With an allow-list the key is locked to those pids; without one pid validation is
      // switched off (CANN releases that cannot do that fail here with the ACL code).
      const uint64_t flags =
          importer_pids ? ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT : ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION;
      char key[kIpcKeyBytes] = {};
      ACL_CHECKED(aclrtIpcMemGetExportKey, alloc->ptr(), alloc->bytes(), key, sizeof key, flags);
      alloc->export_key() = key;
    }
    if (importer_pids && !importer_pids->empty()) {
      ACL_CHECKED(aclrtIpcMemSetImportPid, alloc->export_key().c_str(), importer_pids->data(), importer_pids->size());
    }
  }
  py::dict handle;
  handle["backend"] = "ascend";
  handle["key"] = alloc->export_key();
  handle["offset"] = offset;
  handle["size"] = alloc->bytes();
  handle["shape"] = py::tuple(py::cast(shape));
  handle["strides"] = py::tuple(py::cast(strides));
  handle["dtype"] = dtype.name;
  handle["device"] = alloc->device();
  handle["pid"] = static_cast<int64_t>(getpid());
  return handle;
}

// One imported key, closed (aclrtIpcMemClose) when the last tensor over it dies.
class IpcMapping {
 public:
  IpcMapping(std::string key, int device) : key_(std::move(key)), device_(device) {
    use_device(device_);
    ACL_CHECKED(aclrtIpcMemImportByKey, &ptr_, key_.c_str(), ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS);
  }
  ~IpcMapping() {
    try {  // from torch's storage deleter: no exception may escape
      use_device(device_);
      check(acl().aclrtIpcMemClose(key_.c_str()), "aclrtIpcMemClose");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deepinfer-ascend: closing IPC key %s failed: %s\n", key_.c_str(), e.what());
    }
  }
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  void* ptr() const { return ptr_; }

 private:
  std::string key_;
  int device_;
  void* ptr_ = nullptr;
};

std::mutex g_import_mutex;
std::map<std::string, std::weak_ptr<IpcMapping>> g_imports;  // per-process cache by key

template <typename T>
T handle_field(const py::dict& handle, const char* field) {
  if (!handle.contains(field)) throw py::value_error(std::string("handle has no '") + field + "' field");
  try {
    return handle[field].cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("handle['") + field + "'] has the wrong type: " + py_repr(handle[field]));
  }
}

TensorObj import_ipc_tensor(HandleObj handle_arg) {
  if (!py::isinstance<py::dict>(handle_arg)) {
    throw py::type_error("handle must be the dict export_ipc_tensor returned, got " + py_repr(handle_arg));
  }
  const auto handle = py::reinterpret_borrow<py::dict>(handle_arg);
  const auto backend = handle_field<std::string>(handle, "backend");
  if (backend != "ascend") {
    throw py::value_error("handle['backend']='" + backend + "': this handle was exported by another backend");
  }
  const auto key = handle_field<std::string>(handle, "key");
  const auto offset = handle_field<std::size_t>(handle, "offset");
  const auto size = handle_field<std::size_t>(handle, "size");
  const auto shape = parse_shape(handle["shape"], "handle['shape']");
  const auto strides = parse_shape(handle["strides"], "handle['strides']");
  const DType dtype = parse_dtype(handle_field<py::object>(handle, "dtype"), "handle['dtype']");
  const auto device = handle_field<int>(handle, "device");
  const auto pid = handle_field<int64_t>(handle, "pid");
  if (key.empty() || key.size() >= kIpcKeyBytes) throw py::value_error("handle['key'] is not an ACL IPC key");
  if (shape.size() != strides.size()) throw py::value_error("handle['shape'] and handle['strides'] differ in length");
  checked_numel(shape, dtype.itemsize, "handle['shape']");
  const std::size_t extent = view_extent(shape, strides, dtype.itemsize);
  if (offset > size || extent > size - offset) {
    throw py::value_error("handle describes a view (offset " + std::to_string(offset) + ", " + std::to_string(extent) +
                          " bytes) outside its " + std::to_string(size) + "-byte allocation");
  }
  if (pid == static_cast<int64_t>(getpid())) {
    // ACL refuses to import a key in the process that exported it: hand out the original.
    std::shared_ptr<Allocation> alloc = find_allocation_by_key(key);
    if (!alloc) throw py::value_error("handle was exported by this process but its memory has been freed");
    if (size != alloc->bytes()) throw py::value_error("handle['size'] does not match the exported allocation");
    void* data = static_cast<char*>(alloc->ptr()) + offset;
    return to_torch(std::move(alloc), data, device, dtype, shape, strides);
  }
  std::shared_ptr<IpcMapping> mapping;
  {
    std::lock_guard<std::mutex> lock(g_import_mutex);
    mapping = g_imports[key].lock();
    if (!mapping) {
      mapping = std::make_shared<IpcMapping>(key, device);
      g_imports[key] = mapping;
    }
  }
  void* data = static_cast<char*>(mapping->ptr()) + offset;
  return to_torch(std::move(mapping), data, device, dtype, shape, strides);
}

}  // namespace

void bind_cuda_utils(py::module_& m) {
  m.doc() = "Device memory outside torch's caching allocator, and IPC sharing of it, on AscendCL.";
  m.def("alloc_tensor", &alloc_tensor, py::arg("shape"), py::arg("dtype"), py::arg("device"),
        R"doc(Allocate an uninitialised contiguous tensor with aclrtMalloc, outside torch's caching allocator.
shape: sequence of non-negative ints. dtype: torch.dtype or its name (float32, float16,
bfloat16, float64, int8, int16, int32, int64, uint8, bool). device: NPU index, "npu:N" or a
torch.device. Returns a torch tensor (handed over as a DLPack capsule) whose memory is
released with aclrtFree when the tensor and every view and IPC export of it are gone.
Allocations are rounded up to whole pages (4 KiB, or 2 MiB from 2 MiB on) so that ACL IPC
can share them.
Raises TypeError/ValueError naming the bad argument, AclError naming the failed ACL call.)doc");
  m.def("export_ipc_tensor", &export_ipc_tensor, py::arg("tensor"), py::arg("importer_pids") = py::none(),
        R"doc(Share a tensor from alloc_tensor with other processes.
Returns a picklable dict: backend, key (aclrtIpcMemGetExportKey of the whole allocation),
offset (bytes of the tensor in it), size, shape, strides, dtype, device, pid. Without
importer_pids the key is exported with pid validation disabled; with a list of pids it is
exported with the default flag and locked to those pids (aclrtIpcMemSetImportPid). The
exporting process must keep the tensor alive until every importer has released its tensors.
Raises TypeError for a non-tensor, ValueError for memory that is not from alloc_tensor or
an empty tensor, AclError for a failed ACL call.)doc");
  m.def("import_ipc_tensor", &import_ipc_tensor, py::arg("handle"),
        R"doc(Map a tensor that another process exported with export_ipc_tensor.
The key is imported once per process (aclrtIpcMemImportByKey with peer access enabled),
shared by every tensor imported from it, and closed (aclrtIpcMemClose) when the last of
them dies. A handle exported by this same process returns a tensor over the original
memory. Raises TypeError/ValueError for a malformed handle, AclError for a failed ACL call.)doc");
}

}  // namespace deepinfer_ascend

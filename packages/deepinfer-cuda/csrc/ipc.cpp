// cuda_utils: legacy CUDA IPC (cuIpcGetMemHandle / cuIpcOpenMemHandle) of whole base
// allocations. Opened mappings are cached per process and ref-counted: every imported
// tensor holds one reference and the mapping is closed when the last one dies.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "bindings.h"
#include "device_bytes.h"
#include "driver.h"

namespace py = pybind11;

namespace deepinfer_cuda {
namespace {

struct Mapping {
  CUdeviceptr base = 0;
  int refs = 0;
};

struct MappingCache {
  std::mutex mutex;
  std::map<std::tuple<std::string, int>, Mapping> open;  // (handle bytes, device) -> mapping
};

MappingCache& cache() {
  static MappingCache* state = new MappingCache();  // leaked: releases may run at exit
  return *state;
}

void check_range(int64_t base_nbytes, int64_t offset, int64_t nbytes) {
  if (offset < 0 || nbytes < 0 || base_nbytes < 0 || offset + nbytes > base_nbytes) {
    throw py::value_error("byte range [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                          ") lies outside the shared allocation of " + std::to_string(base_nbytes) + " bytes");
  }
}

py::dict ipc_export(uintptr_t ptr, int device) {
  validate_device(device, "device");
  const DriverApi& api = driver();
  ContextScope scope(device);
  int ordinal = -1;
  CUresult rc = api.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
  if (rc != CUDA_SUCCESS) {
    throw py::value_error("pointer " + hex(ptr) + " is not CUDA device memory known to the driver (" +
                          describe(rc) + ")");
  }
  if (ordinal != device) {
    throw py::value_error("pointer " + hex(ptr) + " lives on CUDA device " + std::to_string(ordinal) +
                          ", not on device=" + std::to_string(device));
  }
  int capable = 0;
  rc = api.cuPointerGetAttribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr);
  if (rc == CUDA_SUCCESS && !capable) {
    throw py::value_error(
        "the memory at " + hex(ptr) +
        " cannot be shared with legacy CUDA IPC: it was not allocated with cuMemAlloc/cudaMalloc "
        "(for example PyTorch's expandable segments, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
        "or a virtual-memory/cuMemCreate pool). Allocate it with alloc_tensor(), or disable expandable "
        "segments");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  check(api.cuMemGetAddressRange(&base, &size, ptr), "cuMemGetAddressRange");
  unsigned long long buffer_id = 0;
  check(api.cuPointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr), "cuPointerGetAttribute(BUFFER_ID)");
  CUipcMemHandle handle;
  rc = api.cuIpcGetMemHandle(&handle, base);
  if (rc != CUDA_SUCCESS) {
    throw CudaError(rc, "cuIpcGetMemHandle of the allocation at " + hex(base) + " failed: " + describe(rc) +
                            " (legacy CUDA IPC shares only cuMemAlloc/cudaMalloc memory)");
  }
  py::dict out;
  out["handle"] = py::bytes(reinterpret_cast<const char*>(handle.reserved), CU_IPC_HANDLE_SIZE);
  out["base_ptr"] = static_cast<uintptr_t>(base);
  out["base_nbytes"] = static_cast<int64_t>(size);
  out["offset"] = static_cast<int64_t>(ptr - base);
  out["buffer_id"] = buffer_id;
  return out;
}

py::capsule ipc_open(py::bytes handle_bytes, int64_t base_nbytes, int64_t offset, int64_t nbytes, int device) {
  std::string key = handle_bytes;
  if (key.size() != CU_IPC_HANDLE_SIZE) {
    throw py::value_error("handle must be " + std::to_string(CU_IPC_HANDLE_SIZE) + " bytes, got " +
                          std::to_string(key.size()));
  }
  check_range(base_nbytes, offset, nbytes);
  validate_device(device, "device");
  CUdeviceptr base = 0;
  {
    py::gil_scoped_release release;
    MappingCache& state = cache();
    std::lock_guard<std::mutex> lock(state.mutex);
    Mapping& mapping = state.open[{key, device}];
    if (mapping.refs == 0) {
      CUipcMemHandle handle;
      std::memcpy(handle.reserved, key.data(), CU_IPC_HANDLE_SIZE);
      ContextScope scope(device);
      CUresult rc = driver().cuIpcOpenMemHandle(&mapping.base, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      if (rc != CUDA_SUCCESS) {
        state.open.erase({key, device});
        throw CudaError(rc, "cuIpcOpenMemHandle failed: " + describe(rc) +
                                " (has the exporting process exited or freed the memory? The exporter must "
                                "outlive every importer)");
      }
    }
    mapping.refs += 1;
    base = mapping.base;
  }
  return make_device_bytes_capsule(static_cast<uintptr_t>(base + offset), nbytes, device, [key, device]() {
    MappingCache& state = cache();
    std::lock_guard<std::mutex> lock(state.mutex);
    auto it = state.open.find({key, device});
    if (it == state.open.end()) return;
    if (--it->second.refs == 0) {
      try {
        ContextScope scope(device);
        driver().cuIpcCloseMemHandle(it->second.base);
      } catch (...) {
      }
      state.open.erase(it);
    }
  });
}

py::capsule wrap_local(uintptr_t base_ptr, unsigned long long buffer_id, int64_t base_nbytes, int64_t offset,
                       int64_t nbytes, int device) {
  check_range(base_nbytes, offset, nbytes);
  validate_device(device, "device");
  const DriverApi& api = driver();
  {
    ContextScope scope(device);
    CUdeviceptr base = 0;
    size_t size = 0;
    unsigned long long current_id = 0;
    bool alive = api.cuMemGetAddressRange(&base, &size, base_ptr) == CUDA_SUCCESS && base == base_ptr &&
                 static_cast<int64_t>(size) == base_nbytes &&
                 api.cuPointerGetAttribute(&current_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base_ptr) == CUDA_SUCCESS &&
                 current_id == buffer_id;
    if (!alive) {
      throw py::value_error("the exported allocation at " + hex(base_ptr) +
                            " no longer exists in this process: the exporter must outlive every importer");
    }
  }
  // Same process: the original memory, not a second mapping; the exporter owns it.
  return make_device_bytes_capsule(base_ptr + offset, nbytes, device, nullptr);
}

size_t open_mapping_count() {
  MappingCache& state = cache();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.open.size();
}

py::bytes device_uuid(int device) {
  validate_device(device, "device");
  CUdevice dev = 0;
  check(driver().cuDeviceGet(&dev, device), "cuDeviceGet");
  CUuuid uuid;
  check(driver().cuDeviceGetUuid(&uuid, dev), "cuDeviceGetUuid");
  return py::bytes(uuid.bytes, sizeof(uuid.bytes));
}

int device_for_uuid(py::bytes uuid) {
  std::string wanted = uuid;
  int count = device_count();
  for (int i = 0; i < count; ++i) {
    if (std::string(device_uuid(i)) == wanted) return i;
  }
  return -1;
}

}  // namespace

void bind_ipc(py::module_& m) {
  m.def("ipc_export", &ipc_export, py::arg("ptr"), py::arg("device"),
        "Describe the base allocation holding device pointer `ptr` for legacy CUDA IPC.\n\n"
        "Returns {'handle': 64 bytes from cuIpcGetMemHandle, 'base_ptr', 'base_nbytes', 'offset' (of ptr in\n"
        "the allocation), 'buffer_id'}. Raises ValueError when `ptr` is not device memory of `device`, or\n"
        "when legacy IPC cannot share it (expandable segments, cuMemCreate pools).");
  m.def("ipc_open", &ipc_open, py::arg("handle"), py::arg("base_nbytes"), py::arg("offset"), py::arg("nbytes"),
        py::arg("device"),
        "Map an exported allocation (cached and ref-counted per process) and return a DLPack capsule of\n"
        "`nbytes` uint8 at `offset`. The mapping is closed when the last capsule/tensor over it dies.\n"
        "Releases the GIL while opening. Raises ValueError for a bad handle or range, CudaError when the\n"
        "driver cannot open it (exporter gone).");
  m.def("wrap_local", &wrap_local, py::arg("base_ptr"), py::arg("buffer_id"), py::arg("base_nbytes"),
        py::arg("offset"), py::arg("nbytes"), py::arg("device"),
        "Same-process import: a non-owning DLPack capsule over the original allocation, after checking\n"
        "(address range and buffer id) that it still exists. Raises ValueError when it was freed.");
  m.def("open_mapping_count", &open_mapping_count, "Number of IPC mappings this process holds open.");
  m.def("device_uuid", &device_uuid, py::arg("device"), "The 16-byte UUID of CUDA device `device`.");
  m.def("device_for_uuid", &device_for_uuid, py::arg("uuid"),
        "Index of the visible CUDA device with this UUID, or -1 when this process cannot see it.");
}

}  // namespace deepinfer_cuda

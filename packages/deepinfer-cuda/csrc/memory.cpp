// cuda_utils: device memory from the driver allocator (cuMemAlloc), outside any
// framework's caching allocator, handed to Python as DLPack capsules.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>

#include "bindings.h"
#include "device_bytes.h"
#include "driver.h"

namespace py = pybind11;

namespace deepinfer_cuda {
namespace {

py::capsule alloc_bytes(int64_t nbytes, int device) {
  if (nbytes < 0) throw py::value_error("nbytes=" + std::to_string(nbytes) + " must be >= 0");
  validate_device(device, "device");
  CUdeviceptr ptr = 0;
  {
    py::gil_scoped_release release;
    ContextScope scope(device);
    // cuMemAlloc refuses 0 bytes; an empty tensor still gets a real (1-byte) allocation.
    CUresult rc = driver().cuMemAlloc(&ptr, nbytes > 0 ? static_cast<size_t>(nbytes) : 1);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
      throw CudaError(rc, "cuMemAlloc of " + std::to_string(nbytes) + " bytes on CUDA device " +
                              std::to_string(device) + " failed: out of memory");
    }
    check(rc, "cuMemAlloc");
  }
  return make_device_bytes_capsule(static_cast<uintptr_t>(ptr), nbytes, device, [ptr, device]() {
    // Runs when torch frees the tensor (possibly at interpreter exit, when the driver may
    // already be shutting down): errors cannot be reported here, so they are ignored.
    try {
      ContextScope scope(device);
      driver().cuMemFree(ptr);
    } catch (...) {
    }
  });
}

py::tuple mem_get_info(int device) {
  validate_device(device, "device");
  size_t free_bytes = 0, total_bytes = 0;
  {
    ContextScope scope(device);
    check(driver().cuMemGetInfo(&free_bytes, &total_bytes), "cuMemGetInfo");
  }
  return py::make_tuple(free_bytes, total_bytes);
}

py::dict driver_info() {
  int version = 0;
  check(driver().cuDriverGetVersion(&version), "cuDriverGetVersion");
  py::dict info;
  info["driver_version"] = version;
  info["device_count"] = device_count();
  return info;
}

}  // namespace

void bind_memory(py::module_& m) {
  m.def("alloc_bytes", &alloc_bytes, py::arg("nbytes"), py::arg("device"),
        "Allocate `nbytes` bytes with cuMemAlloc in the primary context of CUDA device `device`.\n\n"
        "Returns a DLPack capsule ('dltensor') of a 1-D uint8 tensor; its deleter frees the memory\n"
        "with cuMemFree. Releases the GIL while allocating. Raises ValueError for a negative size\n"
        "or an invisible device, CudaError when the driver refuses (out of memory...).\n"
        "Use deepinfer_cuda.cuda_utils.alloc_tensor for typed torch tensors.");
  m.def("mem_get_info", &mem_get_info, py::arg("device"),
        "(free_bytes, total_bytes) of CUDA device `device` from cuMemGetInfo.");
  m.def("driver_info", &driver_info,
        "{'driver_version': int, 'device_count': int} from the loaded CUDA driver.");
}

}  // namespace deepinfer_cuda

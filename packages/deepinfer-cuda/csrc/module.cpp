// deepinfer_cuda._native: the CUDA backend's native module, with the submodules
// cuda_utils and graph_timer. The driver is loaded lazily, at the first call that needs it,
// so importing the module is cheap and works on machines without a GPU.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "driver.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "DeepInfer's CUDA backend (CUDA driver API loaded at run time from libcuda.so.1)";
  auto cuda_error = py::register_exception<deepinfer_cuda::CudaError>(m, "CudaError", PyExc_RuntimeError);
  (void)cuda_error;

  auto cuda_utils = m.def_submodule(
      "cuda_utils", "Device memory from the driver allocator and legacy CUDA IPC, as DLPack capsules");
  deepinfer_cuda::bind_memory(cuda_utils);
  deepinfer_cuda::bind_ipc(cuda_utils);

  auto graph_timer = m.def_submodule("graph_timer", "Timing events and handles on captured CUDA graphs");
  deepinfer_cuda::bind_events(graph_timer);
  deepinfer_cuda::bind_graph(graph_timer);

  // Importable by name (`import deepinfer_cuda._native.graph_timer`, stub generators).
  auto modules = py::module_::import("sys").attr("modules");
  modules["deepinfer_cuda._native.cuda_utils"] = cuda_utils;
  modules["deepinfer_cuda._native.graph_timer"] = graph_timer;
}

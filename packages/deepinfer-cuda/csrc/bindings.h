// Binders of the native module deepinfer_cuda._native, one per source file.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace deepinfer_cuda {

// "0x..." for addresses and handles in error messages and reprs.
inline std::string hex(uintptr_t value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(value));
  return buf;
}

void bind_memory(pybind11::module_& m);  // cuda_utils: allocation
void bind_ipc(pybind11::module_& m);     // cuda_utils: legacy CUDA IPC
void bind_events(pybind11::module_& m);  // graph_timer: EventHandle
void bind_graph(pybind11::module_& m);   // graph_timer: EventRecordNodeHandle, GraphHandle

}  // namespace deepinfer_cuda

// One-dimensional uint8 DLPack capsules over device memory. Both cuda_utils paths
// (fresh allocations and imported IPC mappings) hand memory to Python this way; the
// Python wrapper reinterprets the bytes with torch's view(dtype) / as_strided.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>

namespace deepinfer_cuda {

// Called exactly once when the consumer (torch) drops the memory, or when the capsule
// is garbage-collected unconsumed. May run on any thread, without the GIL.
using ReleaseFn = std::function<void()>;

// A capsule named "dltensor" describing `nbytes` bytes at `ptr` on CUDA device `device`.
pybind11::capsule make_device_bytes_capsule(uintptr_t ptr, int64_t nbytes, int device, ReleaseFn release);

}  // namespace deepinfer_cuda

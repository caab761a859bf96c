// graph_timer: timing events (CUevent with timing enabled) owned by Python objects and
// shared with the graphs whose nodes record them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "driver.h"

namespace deepinfer_cuda {

class EventHandle {
 public:
  // device < 0: the device of the calling thread's current context, else device 0.
  explicit EventHandle(int device);
  ~EventHandle();
  EventHandle(const EventHandle&) = delete;
  EventHandle& operator=(const EventHandle&) = delete;

  CUevent event() const { return event_; }
  int device() const { return device_; }
  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(event_); }

  // Records on `stream`; while the stream is capturing, with CU_EVENT_RECORD_EXTERNAL so the
  // graph gets an event-record node that records on every replay.
  void record(CUstream stream);
  float elapsed_ms(const EventHandle& end) const;
  bool query() const;
  void synchronize() const;

 private:
  CUevent event_ = nullptr;
  int device_ = 0;
};

// Stream arguments: an int (torch.cuda.Stream.cuda_stream) or an object with a
// `cuda_stream` attribute (torch.cuda.Stream). Raises TypeError otherwise.
CUstream stream_from_python(pybind11::handle obj, const char* argument);

// Raises ValueError unless `stream` belongs to `device`'s primary context (the legacy
// default stream 0 always qualifies).
void validate_stream_device(CUstream stream, int device, const char* argument);

}  // namespace deepinfer_cuda

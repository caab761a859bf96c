#include "events.h"

#include <string>

#include "bindings.h"

namespace py = pybind11;

namespace deepinfer_cuda {
namespace {

}  // namespace

CUstream stream_from_python(py::handle obj, const char* argument) {
  py::handle value = obj;
  py::object attr;
  if (!py::isinstance<py::int_>(obj) && py::hasattr(obj, "cuda_stream")) {
    attr = obj.attr("cuda_stream");
    value = attr;
  }
  if (!py::isinstance<py::int_>(value) || py::isinstance<py::bool_>(value)) {
    throw py::type_error(std::string(argument) + " must be a CUDA stream handle (an int such as " +
                         "torch.cuda.current_stream().cuda_stream, or a torch.cuda.Stream), got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  auto raw = value.cast<long long>();
  if (raw < 0) throw py::value_error(std::string(argument) + "=" + std::to_string(raw) + " is not a stream handle");
  return reinterpret_cast<CUstream>(static_cast<uintptr_t>(raw));
}

void validate_stream_device(CUstream stream, int device, const char* argument) {
  // 0, 1 (cudaStreamLegacy) and 2 (cudaStreamPerThread) are the current context's.
  if (reinterpret_cast<uintptr_t>(stream) <= 2) return;
  CUcontext ctx = nullptr;
  CUresult rc = driver().cuStreamGetCtx(stream, &ctx);
  if (rc != CUDA_SUCCESS) {
    throw py::value_error(std::string(argument) + "=" + hex(reinterpret_cast<uintptr_t>(stream)) +
                          " is not a valid CUDA stream (" + describe(rc) + ")");
  }
  if (ctx != primary_context(device)) {
    throw py::value_error(std::string(argument) + "=" + hex(reinterpret_cast<uintptr_t>(stream)) +
                          " belongs to another device or context than CUDA device " + std::to_string(device) +
                          " of this event/graph");
  }
}

EventHandle::EventHandle(int device) {
  if (device < 0) {
    device = current_device_or_none();
    if (device < 0) device = 0;
  }
  validate_device(device, "device");
  device_ = device;
  ContextScope scope(device_);
  check(driver().cuEventCreate(&event_, CU_EVENT_DEFAULT), "cuEventCreate");
}

EventHandle::~EventHandle() {
  if (event_ == nullptr) return;
  try {
    ContextScope scope(device_);
    driver().cuEventDestroy(event_);  // deferred by the driver until pending records finish
  } catch (...) {
  }
}

void EventHandle::record(CUstream stream) {
  ContextScope scope(device_);
  validate_stream_device(stream, device_, "stream");
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  check(driver().cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
  if (status == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    throw py::value_error("stream " + hex(reinterpret_cast<uintptr_t>(stream)) +
                          " is in an invalidated capture; end the capture before recording");
  }
  if (status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    check(driver().cuEventRecordWithFlags(event_, stream, CU_EVENT_RECORD_EXTERNAL),
          "cuEventRecordWithFlags(CU_EVENT_RECORD_EXTERNAL)");
  } else {
    check(driver().cuEventRecord(event_, stream), "cuEventRecord");
  }
}

float EventHandle::elapsed_ms(const EventHandle& end) const {
  if (end.device_ != device_) {
    throw py::value_error("end event is on CUDA device " + std::to_string(end.device_) + ", start on " +
                          std::to_string(device_));
  }
  ContextScope scope(device_);
  float ms = 0.0f;
  CUresult rc = driver().cuEventElapsedTime(&ms, event_, end.event_);
  if (rc == CUDA_ERROR_NOT_READY) {
    throw CudaError(rc, "elapsed_ms: the events have not completed yet; call synchronize() on the end event first");
  }
  if (rc != CUDA_SUCCESS) {
    throw CudaError(rc, "elapsed_ms failed: " + describe(rc) + " (were both events recorded?)");
  }
  return ms;
}

bool EventHandle::query() const {
  ContextScope scope(device_);
  CUresult rc = driver().cuEventQuery(event_);
  if (rc == CUDA_ERROR_NOT_READY) return false;
  check(rc, "cuEventQuery");
  return true;
}

void EventHandle::synchronize() const {
  py::gil_scoped_release release;
  ContextScope scope(device_);
  check(driver().cuEventSynchronize(event_), "cuEventSynchronize");
}

void bind_events(py::module_& m) {
  py::class_<EventHandle, std::shared_ptr<EventHandle>>(
      m, "EventHandle",
      "A CUDA timing event (cuEventCreate with timing enabled) on one device's primary context.\n\n"
      "Record it on a stream; while the stream is being captured into a graph the record becomes an\n"
      "event-record node (CU_EVENT_RECORD_EXTERNAL) that records again on every replay.")
      .def(py::init<int>(), py::arg("device") = -1,
           "Create an event on CUDA device `device` (-1: the device current on this thread, else 0).\n"
           "Raises ValueError for a device this process cannot see.")
      .def(
          "record",
          [](EventHandle& self, py::object stream) { self.record(stream_from_python(stream, "stream")); },
          py::arg("stream") = 0,
          "Record the event on `stream` (int handle such as torch.cuda.current_stream().cuda_stream, or a\n"
          "torch.cuda.Stream). On a capturing stream this adds an event-record node to the graph.\n"
          "Raises TypeError for a non-stream argument, ValueError for a stream of another device.")
      .def("elapsed_ms", &EventHandle::elapsed_ms, py::arg("end"),
           "Milliseconds from this event to `end` (cuEventElapsedTime). Raises CudaError when either\n"
           "has not completed or was never recorded, ValueError when they are on different devices.")
      .def("query", &EventHandle::query, "True when the work before the last record has completed.")
      .def("synchronize", &EventHandle::synchronize,
           "Wait for the last record to complete. Releases the GIL while waiting.")
      .def_property_readonly("device", &EventHandle::device, "The CUDA device index of the event.")
      .def_property_readonly("handle", &EventHandle::handle, "The CUevent as an int.")
      .def("__repr__", [](const EventHandle& self) {
        return "EventHandle(device=" + std::to_string(self.device()) + ", handle=" + hex(self.handle()) + ")";
      });
}

}  // namespace deepinfer_cuda

// The SamplingParams argument of Scheduler.add_request and SequenceMetadataPool.add_sequence.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "core/sampling_params.h"

namespace deepinfer {

// Whether `name` is a field of the Python SamplingParams (bind_sampling_params.cpp).
bool is_sampling_field(const std::string& name);

// The bound SamplingParams given as `name` (None: the defaults, SamplingParams()); TypeError
// naming `name` for anything else. The object validated itself when it was built or changed.
inline const SamplingParams& sampling_params_arg(const pybind11::handle& obj, const char* name) {
  namespace py = pybind11;
  static const SamplingParams defaults;
  if (obj.is_none()) return defaults;
  if (!py::isinstance<SamplingParams>(obj)) {
    std::string hint;
    if (py::hasattr(obj, "engine_params"))  // the runtime's deepinfer.SamplingParams
      hint = " (deepinfer.SamplingParams holds one: pass its .engine)";
    throw py::type_error(std::string(name) + ": expected a deepinfer._C.engine.SamplingParams or None, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))) + hint);
  }
  return obj.cast<const SamplingParams&>();
}

}  // namespace deepinfer

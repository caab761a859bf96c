#include <pybind11/pybind11.h>

#include "core/invalid_argument.h"
#include "python/bindings.h"

PYBIND11_MODULE(_engine, m) {
  m.doc() = "DeepInfer engine core (deepinfer._C.engine)";
  // core/ and step/ report bad input with InvalidArgument: Python sees ValueError("<argument>: <message>").
  pybind11::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const deepinfer::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  deepinfer::bind_sampling_params(m);
  deepinfer::bind_sequence_status(m);
  deepinfer::bind_scheduler_outputs(m);
  deepinfer::bind_sequences(m);
  deepinfer::bind_scheduler(m);
  deepinfer::bind_outputs(m);
  deepinfer::bind_flops(m);
  deepinfer::bind_engram(m);
  deepinfer::bind_inputs(m);
  deepinfer::bind_sampler(m);
  deepinfer::bind_updates(m);
}

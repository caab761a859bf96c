#include "python/bindings.h"

PYBIND11_MODULE(_engine, m) {
  m.doc() = "DeepInfer engine core (deepinfer._C.engine)";
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

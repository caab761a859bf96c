#include "python/bindings.h"

PYBIND11_MODULE(_engine, m) {
  m.doc() = "DeepInfer engine core (deepinfer._C.engine)";
  deepinfer::bind_core(m);
  deepinfer::bind_inputs(m);
}

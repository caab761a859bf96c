#include "python/bindings.h"
#include "python/bindings_inputs.h"

namespace deepinfer {
// Engine core II: every name is bound by its part's binder.
void bind_inputs(pybind11::module_& m) {
  bind_flops(m);
  bind_engram(m);
  bind_prepare(m);
  bind_sampler(m);
  bind_step(m);
}
}  // namespace deepinfer

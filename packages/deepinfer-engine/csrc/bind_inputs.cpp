#include "bindings.h"

namespace deepinfer {
void bind_inputs(pybind11::module_& m) {}
}  // namespace deepinfer

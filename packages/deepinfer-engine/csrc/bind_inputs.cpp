#include "bindings.h"
#include "buffer_check.h"

namespace deepinfer {
void bind_inputs(pybind11::module_& m) {}
}  // namespace deepinfer

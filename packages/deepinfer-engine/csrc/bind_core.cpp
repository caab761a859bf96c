#include "bindings.h"
#include "scheduler.h"

namespace deepinfer {
void bind_core(pybind11::module_& m) {}
}  // namespace deepinfer

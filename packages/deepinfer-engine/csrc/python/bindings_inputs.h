// Binders of Engine core II (called once each from bind_inputs.cpp).
#pragma once
#include <pybind11/pybind11.h>

namespace deepinfer {
void bind_flops(pybind11::module_& m);
void bind_engram(pybind11::module_& m);
void bind_prepare(pybind11::module_& m);
void bind_sampler(pybind11::module_& m);
void bind_step(pybind11::module_& m);
}  // namespace deepinfer

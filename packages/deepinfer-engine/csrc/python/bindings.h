// Each part of the engine binds its own names; module.cpp calls every binder once.
#pragma once
#include <pybind11/pybind11.h>

namespace deepinfer {
// Engine core I: sequences, blocks, scheduler, outputs.
void bind_core(pybind11::module_& m);
// Engine core II: input metadata, sampler inputs, ZOS, MTP, Engram, YOCO, FLOPs.
void bind_inputs(pybind11::module_& m);
}  // namespace deepinfer

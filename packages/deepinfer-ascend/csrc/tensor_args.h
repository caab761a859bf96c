// Parsing and validation of the Python arguments that describe a tensor: dtype, shape,
// device. Bad input is a TypeError/ValueError naming the argument and the wrong value.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dlpack_abi.h"

namespace deepinfer_ascend {

struct DType {
  std::string name;  // torch's name without "torch.", e.g. "float32"
  DLDataType dl;
  std::size_t itemsize;
};

// A torch.dtype or its name ("float16", "torch.float16"); TypeError names `arg`.
DType parse_dtype(pybind11::handle dtype, const char* arg);

// A sequence of non-negative ints; TypeError/ValueError names `arg`.
std::vector<int64_t> parse_shape(pybind11::handle shape, const char* arg);

// An NPU index from an int, "npu", "npu:N" or a torch.device; checked against the device
// count. ValueError names `arg`.
int parse_device(pybind11::handle device, const char* arg);

// Contiguous (row-major) strides, in elements.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

// Element count; ValueError (naming `arg`) when it or its byte size overflows.
std::size_t checked_numel(const std::vector<int64_t>& shape, std::size_t itemsize, const char* arg);

// repr() of a Python object, for error messages.
std::string py_repr(pybind11::handle obj);

}  // namespace deepinfer_ascend

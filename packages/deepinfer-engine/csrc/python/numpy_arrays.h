// Fresh numpy arrays copied from engine data (for properties that return copies).
#pragma once

#include <pybind11/numpy.h>

#include <algorithm>
#include <vector>

#include "core/block_manager.h"

namespace deepinfer {

namespace py = pybind11;

template <class T>
inline py::array_t<T> to_array(const T* data, size_t n) {
  py::array_t<T> a(static_cast<py::ssize_t>(n));
  if (n) std::copy(data, data + n, a.mutable_data());
  return a;
}
template <class T>
inline py::array_t<T> to_array(const std::vector<T>& v) {
  return to_array(v.data(), v.size());
}
inline py::array_t<int32_t> pairs_array(const std::vector<BlockCopy>& v) {
  py::array_t<int32_t> a({static_cast<py::ssize_t>(v.size()), py::ssize_t{2}});
  auto* p = a.mutable_data();
  for (size_t i = 0; i < v.size(); ++i) {
    p[2 * i] = v[i][0];
    p[2 * i + 1] = v[i][1];
  }
  return a;
}

}  // namespace deepinfer

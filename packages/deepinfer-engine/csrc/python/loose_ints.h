// Loose integer parameters (a Python int, a list or any integer numpy array) -> C++ integers.
#pragma once

#include <pybind11/numpy.h>

#include <cstdint>
#include <string>
#include <vector>

#include "python/buffer_check.h"

namespace deepinfer {

// Refuses floats/strings (TypeError) and values below min_value or above int32 (ValueError),
// naming the argument and the index.
inline std::vector<int64_t> loose_int64s(const pybind11::handle& obj, const char* name, int64_t min_value,
                                         int64_t max_value = INT64_MAX) {
  namespace py = pybind11;
  using A = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  if (py::isinstance<py::array>(obj)) {
    const char kind = py::reinterpret_borrow<py::array>(obj).dtype().kind();
    if (kind != 'i' && kind != 'u')
      throw py::type_error(std::string(name) + ": expected integers, got dtype " +
                           std::string(py::str(py::reinterpret_borrow<py::array>(obj).dtype())));
  } else if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj)) {
    throw py::type_error(std::string(name) + ": expected a sequence of ints, got str");
  }
  A a = A::ensure(obj);
  if (!a) {
    PyErr_Clear();
    throw py::type_error(std::string(name) + ": expected a 1-D sequence of ints");
  }
  if (a.ndim() != 1) throw py::value_error(std::string(name) + ": expected a 1-D sequence, got shape " + buf::shape_str(a));
  if (!py::isinstance<py::array>(obj)) {
    // A list of floats would be cast silently; refuse non-integral values.
    for (auto item : obj) {
      if (!py::isinstance<py::int_>(item) && !py::hasattr(item, "__index__"))
        throw py::type_error(std::string(name) + ": expected ints, got " + std::string(py::str(py::type::of(item).attr("__name__"))));
    }
  }
  std::vector<int64_t> v(static_cast<size_t>(a.shape(0)));
  for (py::ssize_t i = 0; i < a.shape(0); ++i) {
    const int64_t x = a.at(i);
    if (x < min_value || x > max_value)
      throw py::value_error(std::string(name) + "[" + std::to_string(i) + "]: must be in [" + std::to_string(min_value) +
                            ", " + std::to_string(max_value) + "], got " + std::to_string(x));
    v[static_cast<size_t>(i)] = x;
  }
  return v;
}

// A Python int (or __index__) as int64; ValueError naming `name` when it does not fit
// (py::cast<int64_t> would raise a RuntimeError "Unable to cast").
inline int64_t python_int64(const pybind11::handle& v, const char* name) {
  namespace py = pybind11;
  py::object idx = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!idx) throw py::error_already_set();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(idx.ptr(), &overflow);
  if (overflow != 0)
    buf::fail(name, std::string(py::str(idx)) + " is out of the int64 range");
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<int64_t>(x);
}

inline std::vector<int32_t> loose_ints(const pybind11::handle& obj, const char* name, int64_t min_value) {
  auto v = loose_int64s(obj, name, min_value, INT32_MAX);
  return std::vector<int32_t>(v.begin(), v.end());
}

}  // namespace deepinfer

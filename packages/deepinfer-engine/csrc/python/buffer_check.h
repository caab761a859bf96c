// Validation of borrowed numpy buffers (arrays the engine reads or writes in place).
//
// Every check throws a Python exception naming the argument and the wrong value:
// wrong dtype -> TypeError; wrong ndim/shape, non C-contiguous, read-only, too small -> ValueError.
// Callers validate every buffer of a call before writing to any of them, so a rejected call
// writes nothing. Must be called with the GIL held.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "step/host_buffers.h"

namespace deepinfer::buf {

namespace py = pybind11;

template <class T>
inline const char* dtype_name() {
  if constexpr (std::is_same_v<T, int32_t>) return "int32";
  else if constexpr (std::is_same_v<T, int64_t>) return "int64";
  else if constexpr (std::is_same_v<T, uint8_t>) return "uint8";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, double>) return "float64";
  else if constexpr (std::is_same_v<T, uint64_t>) return "uint64";
  else return "?";
}

inline std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a.shape(i));
  }
  if (a.ndim() == 1) s += ",";
  return s + ")";
}

// Checks that `obj` is a numpy array of dtype T with `ndim` dimensions, C-contiguous and
// (when `writable`) writable. Returns it as py::array.
template <class T>
inline py::array check_array(const py::handle& obj, const char* name, int ndim, bool writable) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(name) + ": expected a numpy.ndarray of dtype " + dtype_name<T>() +
                         ", got " + std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  auto a = py::reinterpret_borrow<py::array>(obj);
  if (!a.dtype().is(py::dtype::of<T>())) {
    throw py::type_error(std::string(name) + ": expected dtype " + dtype_name<T>() + ", got " +
                         std::string(py::str(a.dtype())));
  }
  if (a.ndim() != ndim) {
    throw py::value_error(std::string(name) + ": expected a " + std::to_string(ndim) + "-D array, got shape " +
                          shape_str(a));
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) + ": must be C-contiguous (got strides that are not; pass "
                          "np.ascontiguousarray(x) or a contiguous tensor view)");
  }
  if (writable && !a.writeable()) {
    throw py::value_error(std::string(name) + ": must be writable (got a read-only array)");
  }
  return a;
}

// 1-D buffer with at least `min_size` elements.
template <class T>
inline Buf1D<T> check_1d(const py::handle& obj, const char* name, size_t min_size, bool writable = true) {
  py::array a = check_array<T>(obj, name, 1, writable);
  if (static_cast<size_t>(a.shape(0)) < min_size) {
    throw py::value_error(std::string(name) + ": capacity " + std::to_string(a.shape(0)) + " < required " +
                          std::to_string(min_size));
  }
  return {static_cast<T*>(writable ? a.mutable_data() : const_cast<void*>(a.data())),
          static_cast<size_t>(a.shape(0))};
}

// 2-D buffer with at least `min_rows` rows and exactly `cols` columns (cols < 0: any).
template <class T>
inline Buf2D<T> check_2d(const py::handle& obj, const char* name, size_t min_rows, long cols,
                         bool writable = true) {
  py::array a = check_array<T>(obj, name, 2, writable);
  if (static_cast<size_t>(a.shape(0)) < min_rows) {
    throw py::value_error(std::string(name) + ": " + std::to_string(a.shape(0)) + " rows < required " +
                          std::to_string(min_rows) + " (shape " + shape_str(a) + ")");
  }
  if (cols >= 0 && a.shape(1) != cols) {
    throw py::value_error(std::string(name) + ": expected " + std::to_string(cols) + " columns, got shape " +
                          shape_str(a));
  }
  return {static_cast<T*>(writable ? a.mutable_data() : const_cast<void*>(a.data())),
          static_cast<size_t>(a.shape(0)), static_cast<size_t>(a.shape(1))};
}

// Input (read-only) 1-D array of exactly `size` elements (size < 0: any length).
template <class T>
inline Buf1D<const T> check_input_1d(const py::handle& obj, const char* name, long size = -1) {
  py::array a = check_array<T>(obj, name, 1, false);
  if (size >= 0 && a.shape(0) != size) {
    throw py::value_error(std::string(name) + ": expected " + std::to_string(size) + " elements, got shape " +
                          shape_str(a));
  }
  return {static_cast<const T*>(a.data()), static_cast<size_t>(a.shape(0))};
}

// Throws ValueError "<name>: <what>" — for checks on values rather than buffers.
[[noreturn]] inline void fail(const char* name, const std::string& what) {
  throw py::value_error(std::string(name) + ": " + what);
}

}  // namespace deepinfer::buf

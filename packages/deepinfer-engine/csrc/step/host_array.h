// A numpy-owned growable host array: C++ writes through a raw pointer (no GIL needed); Python
// reads views of it. Growth allocates a new numpy array (GIL needed) and never frees memory a
// Python view still holds, so a view taken at step N stays valid (with step-N data) forever.
#pragma once

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstring>

namespace deepinfer {

template <class T>
struct HostArray {
  pybind11::array_t<T> array;
  T* data = nullptr;
  size_t capacity = 0;

  // Capacity for n elements (doubling). GIL must be held.
  void reserve(size_t n) {
    if (n <= capacity && data) return;
    size_t cap = std::max<size_t>({n, capacity * 2, 16});
    pybind11::array_t<T> next(static_cast<pybind11::ssize_t>(cap));
    T* p = next.mutable_data();
    if (capacity) std::memcpy(p, data, sizeof(T) * capacity);
    array = std::move(next);
    data = p;
    capacity = cap;
  }
  // A view of the first n elements (GIL held).
  pybind11::array view(size_t n) const {
    if (!data) return pybind11::array_t<T>(0);
    return array[pybind11::slice(0, static_cast<pybind11::ssize_t>(n), 1)];
  }
  T& operator[](size_t i) { return data[i]; }
};

}  // namespace deepinfer

// A numpy-owned growable host array: C++ writes through a raw pointer (no GIL needed); Python
// reads read-only views of it. Growth allocates a new numpy array (GIL needed) and never frees
// memory a Python view still holds, so a view never dangles; its contents are the step's until
// the next call that fills the array (then it shows the new values, or old ones after a growth).
#pragma once

#include <pybind11/numpy.h>

#include <algorithm>
#include <cstring>

namespace deepinfer {

// Clears the array's WRITEABLE flag: engine-owned data that Python reads but must not write.
inline pybind11::array read_only(pybind11::array a) {
  pybind11::detail::array_proxy(a.ptr())->flags &= ~pybind11::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

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
  // A read-only view of the first n elements (GIL held).
  pybind11::array view(size_t n) const {
    if (!data) return read_only(pybind11::array_t<T>(0));
    return read_only(pybind11::array_t<T>({static_cast<pybind11::ssize_t>(n)}, {static_cast<pybind11::ssize_t>(sizeof(T))},
                                          data, array));
  }
  T& operator[](size_t i) { return data[i]; }
};

}  // namespace deepinfer

// The numpy implementation of step/'s growable output buffers: each growth allocates a new
// numpy array (GIL needed), and Python reads views of the used prefix. An earlier array stays
// alive while a view of it does, so a view taken at step N keeps pointing at valid memory.
#pragma once

#include <pybind11/numpy.h>

#include <cstring>

#include "step/output_buffer.h"

namespace deepinfer {

template <class T>
class NumpyStorage final : public BufferStorage<T> {
 public:
  // GIL held.
  T* grow(size_t capacity, const T* old, size_t keep) override {
    pybind11::array_t<T> next(static_cast<pybind11::ssize_t>(capacity));
    T* p = next.mutable_data();
    if (keep) std::memcpy(p, old, sizeof(T) * keep);
    array_ = std::move(next);
    return p;
  }
  const pybind11::array_t<T>& array() const { return array_; }

 private:
  pybind11::array_t<T> array_;
};

using NumpyStorageFactory = StorageFactoryOf<NumpyStorage>;

// A numpy view of the first n elements of a buffer backed by NumpyStorage (GIL held).
template <class T>
pybind11::array numpy_view(const OutputBuffer<T>& b, size_t n) {
  if (!b.data) return pybind11::array_t<T>(0);
  const auto& storage = static_cast<const NumpyStorage<T>&>(*b.storage);
  return storage.array()[pybind11::slice(0, static_cast<pybind11::ssize_t>(n), 1)];
}

}  // namespace deepinfer

// The numpy implementation of step/'s growable output buffers: each growth allocates a new
// numpy array (GIL needed), and Python reads read-only views of the used prefix. An earlier
// array stays alive while a view of it does, so a view never dangles; its contents are the
// step's until the next call that fills the buffer (then the new values, or the old ones after
// a growth).
#pragma once

#include <pybind11/numpy.h>

#include <cstring>

#include "step/output_buffer.h"

namespace deepinfer {

// Clears the array's WRITEABLE flag: engine-owned data that Python reads but must not write.
inline pybind11::array read_only(pybind11::array a) {
  pybind11::detail::array_proxy(a.ptr())->flags &= ~pybind11::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

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

// A read-only numpy view of the first n elements of a buffer backed by NumpyStorage (GIL held).
template <class T>
pybind11::array numpy_view(const OutputBuffer<T>& b, size_t n) {
  if (!b.data) return read_only(pybind11::array_t<T>(0));
  const auto& storage = static_cast<const NumpyStorage<T>&>(*b.storage);
  return read_only(pybind11::array_t<T>({static_cast<pybind11::ssize_t>(n)}, {static_cast<pybind11::ssize_t>(sizeof(T))},
                                        b.data, storage.array()));
}

}  // namespace deepinfer

// Borrowed host buffers: memory owned by the caller (numpy arrays, pinned tensors, vectors) that
// the input builders write in place. Whoever borrows them checks their element type and layout
// (python/buffer_check.h for numpy arrays); step/ checks their sizes.
#pragma once

#include <cstddef>
#include <string>

namespace deepinfer::buf {

// A borrowed 1-D buffer: data pointer and capacity in elements (data null: not given).
template <class T>
struct Buf1D {
  T* data = nullptr;
  size_t size = 0;
};

// A borrowed 2-D C-contiguous buffer.
template <class T>
struct Buf2D {
  T* data = nullptr;
  size_t rows = 0, cols = 0;
  T* row(size_t r) const { return data + r * cols; }
};

template <class T>
std::string shape_str(const Buf2D<T>& b) {
  return "(" + std::to_string(b.rows) + ", " + std::to_string(b.cols) + ")";
}

}  // namespace deepinfer::buf

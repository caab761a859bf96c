// Growable output arrays of the step builders (SamplerInputs), behind a small interface so that
// step/ needs no Python: whoever creates the outputs decides where their memory lives. The
// Python binding backs them with numpy arrays it hands out as views (python/numpy_buffer.h);
// C++ users and tests use VectorStorage.
//
// The builders write through `data` (no virtual call on the hot path) and call reserve() only
// when a step needs more room than `capacity`; a reserve may need the caller's locks (the
// numpy storage needs the GIL), so builders do it outside their write passes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace deepinfer {

// Where an OutputBuffer's elements live. grow() returns storage for `capacity` elements whose
// first `keep` elements equal `old[0, keep)`; memory handed out before may stay alive (views).
template <class T>
class BufferStorage {
 public:
  virtual ~BufferStorage() = default;
  virtual T* grow(size_t capacity, const T* old, size_t keep) = 0;
};

// Plain C++ storage (a std::vector per growth; earlier vectors are freed).
template <class T>
class VectorStorage final : public BufferStorage<T> {
 public:
  T* grow(size_t capacity, const T* old, size_t keep) override {
    std::vector<T> next(capacity);
    if (keep) std::memcpy(next.data(), old, sizeof(T) * keep);
    data_ = std::move(next);
    return data_.data();
  }

 private:
  std::vector<T> data_;
};

template <class T>
struct OutputBuffer {
  T* data = nullptr;
  size_t capacity = 0;
  std::unique_ptr<BufferStorage<T>> storage;

  bool fits(size_t n) const { return data != nullptr && n <= capacity; }
  // Room for n elements (doubling), keeping the current contents.
  void reserve(size_t n) {
    if (fits(n)) return;
    const size_t cap = std::max<size_t>({n, capacity * 2, 16});
    data = storage->grow(cap, data, capacity);
    capacity = cap;
  }
  T& operator[](size_t i) { return data[i]; }
};

// Makes the storage of every OutputBuffer of an output object (one per element type).
class BufferStorageFactory {
 public:
  virtual ~BufferStorageFactory() = default;
  virtual std::unique_ptr<BufferStorage<int32_t>> int32() const = 0;
  virtual std::unique_ptr<BufferStorage<int64_t>> int64() const = 0;
  virtual std::unique_ptr<BufferStorage<float>> float32() const = 0;
  virtual std::unique_ptr<BufferStorage<uint8_t>> uint8() const = 0;

  template <class T>
  std::unique_ptr<BufferStorage<T>> make() const {
    if constexpr (std::is_same_v<T, int32_t>) return int32();
    else if constexpr (std::is_same_v<T, int64_t>) return int64();
    else if constexpr (std::is_same_v<T, float>) return float32();
    else return uint8();
  }
};

// The factory of one BufferStorage template (VectorStorage, the numpy storage).
template <template <class> class Storage>
class StorageFactoryOf final : public BufferStorageFactory {
 public:
  std::unique_ptr<BufferStorage<int32_t>> int32() const override { return std::make_unique<Storage<int32_t>>(); }
  std::unique_ptr<BufferStorage<int64_t>> int64() const override { return std::make_unique<Storage<int64_t>>(); }
  std::unique_ptr<BufferStorage<float>> float32() const override { return std::make_unique<Storage<float>>(); }
  std::unique_ptr<BufferStorage<uint8_t>> uint8() const override { return std::make_unique<Storage<uint8_t>>(); }
};

using VectorStorageFactory = StorageFactoryOf<VectorStorage>;

}  // namespace deepinfer

// Flat hash map from a block's chained prefix hash to its block id (open addressing, linear
// probing, backward-shift deletion): no allocation after construction, one or two cache lines
// per lookup. At most one block per hash (the prefix cache never holds two blocks for a hash).
#pragma once

#include <cstdint>
#include <vector>

namespace deepinfer {

class BlockHashTable {
 public:
  explicit BlockHashTable(size_t max_entries) {
    size_t cap = 16;
    int bits = 4;
    while (cap < 2 * max_entries) {
      cap <<= 1;
      ++bits;
    }
    shift_ = 64 - bits;
    mask_ = cap - 1;
    keys_.assign(cap, 0);
    vals_.assign(cap, -1);
  }

  size_t size() const { return size_; }

  // Block holding `key`, or -1.
  int32_t find(uint64_t key) const {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (vals_[i] < 0) return -1;
      if (keys_[i] == key) return vals_[i];
    }
  }

  // Inserts key -> block unless the key is present; returns whether it inserted.
  bool insert(uint64_t key, int32_t block) {
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (vals_[i] < 0) {
        keys_[i] = key;
        vals_[i] = block;
        ++size_;
        return true;
      }
      if (keys_[i] == key) return false;
    }
  }

  // Removes key if it maps to `block`.
  void erase(uint64_t key, int32_t block) {
    size_t i = slot(key);
    for (;; i = (i + 1) & mask_) {
      if (vals_[i] < 0) return;
      if (keys_[i] == key) break;
    }
    if (vals_[i] != block) return;
    // Backward shift: pull later entries of the probe run into the hole when their home slot
    // is not cyclically within (hole, their position].
    for (size_t j = (i + 1) & mask_; vals_[j] >= 0; j = (j + 1) & mask_) {
      const size_t k = slot(keys_[j]);
      const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      keys_[i] = keys_[j];
      vals_[i] = vals_[j];
      i = j;
    }
    vals_[i] = -1;
    --size_;
  }

  template <class F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < vals_.size(); ++i)
      if (vals_[i] >= 0) f(keys_[i], vals_[i]);
  }

 private:
  size_t slot(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }

  int shift_;
  size_t mask_;
  size_t size_ = 0;
  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
};

}  // namespace deepinfer

// Engram (DeepSeek's conditional memory): token id -> compressed id through a vocabulary
// lookup table, then hashes of the last n compressed ids -> embedding-table rows.
//
// The hash (the numpy reference in tests/engine/inputs_reference/engram.py mirrors it), all
// arithmetic modulo 2^64, for layer l, n-gram order n = orders[o], head h, token position t:
//   x = seed[l] + n * K1 + (h + 1) * K2
//   for i in 0..n-1:  c = compressed[t - n + 1 + i] (PAD = 2^32 - 1 before the first token)
//                     x = (x ^ c) * K3
//   x ^= x >> 31;  index = x % table_sizes[o]
// Columns are ordered layer-major, then order, then head.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace deepinfer {

inline constexpr uint64_t kEngramK1 = 0x9E3779B97F4A7C15ull;
inline constexpr uint64_t kEngramK2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr uint64_t kEngramK3 = 0x100000001B3ull;
inline constexpr uint64_t kEngramPad = 0xFFFFFFFFull;
inline constexpr int kEngramMaxOrder = 16;

struct EngramConfig {
  std::vector<int32_t> orders;       // n-gram orders, each in [1, kEngramMaxOrder]
  int32_t heads_per_order = 0;
  std::vector<uint64_t> layer_seeds;  // one per Engram layer
  std::vector<int64_t> table_sizes;   // one per order, each in [1, 2^31)
  bool enabled() const { return !orders.empty(); }
  size_t num_columns() const { return layer_seeds.size() * orders.size() * static_cast<size_t>(heads_per_order); }
  int32_t max_order() const;
  // Throws InvalidArgument naming the field.
  void validate() const;
};

// The installed lookup table (shared, immutable once installed; replaced atomically).
using EngramTable = std::vector<int32_t>;
std::shared_ptr<const EngramTable> engram_table();
void set_engram_table(std::shared_ptr<const EngramTable> table);

// Writes the hash-index row (num_columns values) of one token from its compressed window:
// cfg.max_order() compressed ids ending at the token, oldest first, kEngramPad before the
// sequence start.
void engram_hash_window(const EngramConfig& cfg, const uint64_t* window, int32_t* out_row);

}  // namespace deepinfer

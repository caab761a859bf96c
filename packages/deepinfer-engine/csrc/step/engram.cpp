#include "step/engram.h"

#include <atomic>
#include <string>

#include "core/invalid_argument.h"

namespace deepinfer {

namespace {
std::shared_ptr<const EngramTable> g_table;  // accessed only through std::atomic_load/store
}

std::shared_ptr<const EngramTable> engram_table() { return std::atomic_load(&g_table); }
void set_engram_table(std::shared_ptr<const EngramTable> table) { std::atomic_store(&g_table, std::move(table)); }

int32_t EngramConfig::max_order() const {
  int32_t m = 0;
  for (int32_t n : orders) m = n > m ? n : m;
  return m;
}

void EngramConfig::validate() const {
  if (orders.empty()) return;
  for (size_t i = 0; i < orders.size(); ++i) {
    if (orders[i] < 1 || orders[i] > kEngramMaxOrder)
      throw InvalidArgument("engram_ngram_orders[" + std::to_string(i) + "]", "must be in [1, " +
                                  std::to_string(kEngramMaxOrder) + "], got " + std::to_string(orders[i]));
  }
  if (heads_per_order < 1)
    throw InvalidArgument("engram_heads_per_order", "must be >= 1, got " + std::to_string(heads_per_order));
  if (layer_seeds.empty()) throw InvalidArgument("engram_layer_seeds", "must name at least one layer");
  if (table_sizes.size() != orders.size())
    throw InvalidArgument("engram_table_sizes", "need one size per n-gram order (" +
                                std::to_string(orders.size()) + "), got " + std::to_string(table_sizes.size()));
  for (size_t i = 0; i < table_sizes.size(); ++i) {
    if (table_sizes[i] < 1 || table_sizes[i] > INT32_MAX)
      throw InvalidArgument("engram_table_sizes[" + std::to_string(i) + "]", "must be in [1, 2^31), got " +
                                  std::to_string(table_sizes[i]));
  }
}

void engram_hash_window(const EngramConfig& cfg, const uint64_t* window, int32_t* out_row) {
  const int32_t maxn = cfg.max_order();
  size_t col = 0;
  for (uint64_t seed : cfg.layer_seeds) {
    for (size_t o = 0; o < cfg.orders.size(); ++o) {
      const int32_t n = cfg.orders[o];
      const uint64_t size = static_cast<uint64_t>(cfg.table_sizes[o]);
      const uint64_t* w = window + (maxn - n);
      for (int32_t h = 0; h < cfg.heads_per_order; ++h) {
        uint64_t x = seed + static_cast<uint64_t>(n) * kEngramK1 + static_cast<uint64_t>(h + 1) * kEngramK2;
        for (int32_t i = 0; i < n; ++i) x = (x ^ w[i]) * kEngramK3;
        x ^= x >> 31;
        out_row[col++] = static_cast<int32_t>(x % size);
      }
    }
  }
}

}  // namespace deepinfer

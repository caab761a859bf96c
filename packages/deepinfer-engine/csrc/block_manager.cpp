#include "block_manager.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace deepinfer {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
                           int32_t watermark_blocks, int32_t hash_bits)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      watermark_blocks_(watermark_blocks),
      hash_mask_(hash_bits >= 64 ? ~uint64_t{0} : ((uint64_t{1} << hash_bits) - 1)),
      ref_(num_blocks, 0),
      cached_(num_blocks, 0),
      hash_(num_blocks, 0),
      parent_(num_blocks, -1),
      parent_gen_(num_blocks, 0),
      gen_(num_blocks, 0),
      tokens_(enable_prefix_caching ? static_cast<size_t>(num_blocks) * block_size : 0),
      table_(enable_prefix_caching ? static_cast<size_t>(num_blocks) : 1),
      lru_prev_(num_blocks, -1),
      lru_next_(num_blocks, -1),
      first_child_(num_blocks, -1),
      next_sibling_(num_blocks, -1),
      prev_sibling_(num_blocks, -1),
      in_lru_(num_blocks, 0) {
  free_stack_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_stack_.push_back(b);  // block 0 is used first
}

uint64_t BlockManager::hash_block(uint64_t parent, const int32_t* tokens) const {
  // FNV-1a style over 64-bit words of two tokens, then a splitmix64 finalizer. Speed matters
  // more than quality: every hit is verified against the stored tokens.
  uint64_t h = parent ^ 0x9E3779B97F4A7C15ull;
  int32_t i = 0;
  for (; i + 1 < block_size_; i += 2) {
    uint64_t w = static_cast<uint32_t>(tokens[i]) | (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i + 1])) << 32);
    h = (h ^ w) * 0x100000001B3ull;
    h ^= h >> 29;
  }
  if (i < block_size_) h = (h ^ static_cast<uint32_t>(tokens[i])) * 0x100000001B3ull;
  h ^= h >> 30;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 27;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 31;
  return h & hash_mask_;
}

void BlockManager::extend_hashes(std::vector<uint64_t>& hashes, const int32_t* tokens, int32_t num_tokens) const {
  const size_t full = static_cast<size_t>(num_tokens / block_size_);
  while (hashes.size() < full) {
    const size_t i = hashes.size();
    hashes.push_back(hash_block(i ? hashes[i - 1] : 0, tokens + i * block_size_));
  }
}

int32_t BlockManager::match_prefix(const std::vector<uint64_t>& hashes, const int32_t* tokens, int32_t max_blocks,
                                   std::vector<int32_t>& out) const {
  out.clear();
  if (!prefix_caching_) return 0;
  const int32_t n = std::min<int32_t>(max_blocks, static_cast<int32_t>(hashes.size()));
  int32_t prev = -1;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t c = table_.find(hashes[i]);
    if (c < 0) break;
    // Verify: the stored tokens and the chain (parent = the block matched for i-1).
    if (!cached_[c] || hash_[c] != hashes[i]) break;
    if (std::memcmp(&tokens_[static_cast<size_t>(c) * block_size_], tokens + static_cast<size_t>(i) * block_size_,
                    sizeof(int32_t) * block_size_) != 0)
      break;
    if (parent_[c] != prev || (prev >= 0 && parent_gen_[c] != gen_[prev])) break;
    out.push_back(c);
    prev = c;
  }
  return static_cast<int32_t>(out.size());
}

void BlockManager::record_lookup(int64_t queried, int64_t hits) {
  prefix_queries_ += queried;
  prefix_hits_ += hits;
}

int32_t BlockManager::num_free_among(const int32_t* blocks, int32_t n) const {
  int32_t k = 0;
  for (int32_t i = 0; i < n; ++i) k += ref_[blocks[i]] == 0;
  return k;
}

void BlockManager::acquire(const int32_t* blocks, int32_t n, std::vector<int32_t>& table) {
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = blocks[i];
    if (ref_[b] == 0) lru_remove(b);
    ++ref_[b];
    table.push_back(b);
  }
}

int32_t BlockManager::blocks_needed(const std::vector<int32_t>& table, int32_t num_written, int32_t num_slots) const {
  const int32_t size = static_cast<int32_t>(table.size());
  int32_t need = std::max(0, blocks_for(num_slots) - size);
  const int32_t idx = num_written / block_size_;
  if (num_slots > num_written && idx < size && ref_[table[idx]] > 1) ++need;  // copy-on-write
  return need;
}

bool BlockManager::ensure_slots(std::vector<int32_t>& table, int32_t num_written, int32_t num_slots,
                                std::vector<BlockCopy>& copies) {
  const int32_t need = blocks_needed(table, num_written, num_slots);
  if (need == 0) return true;
  if (need > num_free_blocks()) return false;
  const int32_t idx = num_written / block_size_;
  if (num_slots > num_written && idx < static_cast<int32_t>(table.size()) && ref_[table[idx]] > 1) {
    const int32_t old = table[idx];
    const int32_t nb = alloc_block();
    if (num_written % block_size_ != 0) {  // the block holds KV that the copy must carry
      copies.push_back({old, nb});
      ++cow_copies_;
    }
    release(old);
    table[idx] = nb;
  }
  const size_t want = static_cast<size_t>(blocks_for(num_slots));
  while (table.size() < want) table.push_back(alloc_block());
  return true;
}

void BlockManager::trim(std::vector<int32_t>& table, int32_t num_slots) {
  const size_t keep = static_cast<size_t>(blocks_for(num_slots));
  while (table.size() > keep) {
    release(table.back());
    table.pop_back();
  }
}

void BlockManager::free_table(std::vector<int32_t>& table) {
  for (size_t i = table.size(); i-- > 0;) release(table[i]);
  table.clear();
}

void BlockManager::fork_table(const std::vector<int32_t>& src, int32_t num_written, std::vector<int32_t>& dst,
                              std::vector<BlockCopy>& copies) {
  dst.clear();
  const int32_t full = num_written / block_size_;
  for (int32_t i = 0; i < full; ++i) {
    ++ref_[src[i]];
    dst.push_back(src[i]);
  }
  if (num_written % block_size_ == 0) return;
  const int32_t partial = src[full];
  if (num_free_blocks() > 0) {
    const int32_t nb = alloc_block();
    copies.push_back({partial, nb});
    ++cow_copies_;
    dst.push_back(nb);
  } else {
    ++ref_[partial];
    dst.push_back(partial);
  }
}

int32_t BlockManager::register_blocks(const std::vector<int32_t>& table, const std::vector<uint64_t>& hashes,
                                      const int32_t* tokens, int32_t first, int32_t last) {
  if (!prefix_caching_) return last;
  for (int32_t i = first; i < last; ++i) {
    const int32_t b = table[i];
    if (cached_[b]) continue;  // a hit, or shared with the sequence that registered it
    const int32_t prev = i ? table[i - 1] : -1;
    if (prev >= 0 && !cached_[prev]) continue;  // chain broken: this prefix cannot be verified
    if (!table_.insert(hashes[i], b)) continue;  // the same prefix (or a colliding one) already holds this hash
    cached_[b] = 1;
    hash_[b] = hashes[i];
    parent_[b] = prev;
    parent_gen_[b] = prev >= 0 ? gen_[prev] : 0;
    std::memcpy(&tokens_[static_cast<size_t>(b) * block_size_], tokens + static_cast<size_t>(i) * block_size_,
                sizeof(int32_t) * block_size_);
    if (prev >= 0) {  // link as a cached child of prev
      next_sibling_[b] = first_child_[prev];
      prev_sibling_[b] = -1;
      if (first_child_[prev] >= 0) prev_sibling_[first_child_[prev]] = b;
      first_child_[prev] = b;
    } else {
      next_sibling_[b] = prev_sibling_[b] = -1;
    }
    first_child_[b] = -1;
  }
  return last;
}

void BlockManager::reset_prefix_cache() {
  for (int32_t b = 0; b < num_blocks_; ++b)
    if (cached_[b] && parent_[b] < 0) uncache(b);  // cascades to every descendant
}

BlockManagerStats BlockManager::stats() const {
  BlockManagerStats s;
  s.num_blocks = num_blocks_;
  s.num_free_blocks = num_free_blocks();
  s.num_cached_blocks = static_cast<int32_t>(table_.size());
  s.prefix_queries = prefix_queries_;
  s.prefix_hits = prefix_hits_;
  s.num_evictions = evictions_;
  s.num_cow_copies = cow_copies_;
  return s;
}

int32_t BlockManager::alloc_block() {
  int32_t b;
  if (!free_stack_.empty()) {
    b = free_stack_.back();
    free_stack_.pop_back();
  } else {
    b = lru_head_;  // evict the least recently freed cached block (and its cached descendants)
    ++evictions_;
    uncache(b);  // moves b (last, on top) and its free descendants from the LRU to the free stack
    free_stack_.pop_back();
  }
  ref_[b] = 1;
  return b;
}

void BlockManager::release(int32_t b) {
  if (--ref_[b] == 0) {
    if (cached_[b]) lru_push(b);
    else free_stack_.push_back(b);
  }
}

void BlockManager::lru_push(int32_t b) {
  lru_prev_[b] = lru_tail_;
  lru_next_[b] = -1;
  if (lru_tail_ >= 0) lru_next_[lru_tail_] = b;
  else lru_head_ = b;
  lru_tail_ = b;
  in_lru_[b] = 1;
  ++num_lru_;
}

void BlockManager::lru_remove(int32_t b) {
  const int32_t p = lru_prev_[b], n = lru_next_[b];
  if (p >= 0) lru_next_[p] = n;
  else lru_head_ = n;
  if (n >= 0) lru_prev_[n] = p;
  else lru_tail_ = p;
  lru_prev_[b] = lru_next_[b] = -1;
  in_lru_[b] = 0;
  --num_lru_;
}

// Takes b and every cached descendant out of the prefix cache. Free ones move from the LRU to
// the free stack (b itself last, so alloc_block can pop it).
void BlockManager::uncache(int32_t root) {
  // Unlink root from its parent's child list.
  const int32_t p = parent_[root];
  if (p >= 0) {
    if (prev_sibling_[root] >= 0) next_sibling_[prev_sibling_[root]] = next_sibling_[root];
    else first_child_[p] = next_sibling_[root];
    if (next_sibling_[root] >= 0) prev_sibling_[next_sibling_[root]] = prev_sibling_[root];
  }
  uncache_stack_.clear();
  uncache_stack_.push_back(root);
  std::vector<int32_t>& order = uncache_order_;  // root first
  order.clear();
  while (!uncache_stack_.empty()) {
    const int32_t b = uncache_stack_.back();
    uncache_stack_.pop_back();
    order.push_back(b);
    for (int32_t c = first_child_[b]; c >= 0; c = next_sibling_[c]) uncache_stack_.push_back(c);
  }
  // Descendants first onto the free stack, root last (on top).
  for (size_t i = order.size(); i-- > 0;) {
    const int32_t b = order[i];
    table_.erase(hash_[b], b);
    cached_[b] = 0;
    ++gen_[b];
    parent_[b] = -1;
    first_child_[b] = next_sibling_[b] = prev_sibling_[b] = -1;
    if (in_lru_[b]) {
      lru_remove(b);
      free_stack_.push_back(b);
    }
  }
}

std::string BlockManager::check_consistency(const std::vector<const std::vector<int32_t>*>& tables) const {
  std::vector<int32_t> owners(num_blocks_, 0);
  for (const auto* t : tables)
    for (int32_t b : *t) {
      if (b < 0 || b >= num_blocks_) return "block id " + std::to_string(b) + " out of range";
      ++owners[b];
    }
  std::vector<int32_t> seen(num_blocks_, 0);
  for (int32_t b : free_stack_) {
    if (seen[b]++) return "block " + std::to_string(b) + " twice on the free stack";
    if (cached_[b]) return "cached block " + std::to_string(b) + " on the uncached free stack";
  }
  int32_t n_lru = 0;
  for (int32_t b = lru_head_; b >= 0; b = lru_next_[b]) {
    if (seen[b]++) return "block " + std::to_string(b) + " free twice (LRU)";
    if (!cached_[b]) return "uncached block " + std::to_string(b) + " in the LRU";
    if (++n_lru > num_blocks_) return "LRU cycle";
  }
  if (n_lru != num_lru_) return "LRU count mismatch";
  int32_t used = 0;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (ref_[b] != owners[b])
      return "block " + std::to_string(b) + ": ref count " + std::to_string(ref_[b]) + " != owners " +
             std::to_string(owners[b]);
    if (ref_[b] > 0 && seen[b]) return "block " + std::to_string(b) + " both used and free";
    if (ref_[b] == 0 && !seen[b]) return "block " + std::to_string(b) + " leaked (unowned, not free)";
    used += ref_[b] > 0;
    if (cached_[b]) {
      if (table_.find(hash_[b]) != b) return "cached block " + std::to_string(b) + " not in the hash table";
      if (parent_[b] >= 0 && (!cached_[parent_[b]] || gen_[parent_[b]] != parent_gen_[b]))
        return "cached block " + std::to_string(b) + " has a stale parent";
    }
  }
  if (used + num_free_blocks() != num_blocks_) return "free + used != total";
  std::string bad;
  table_.for_each([&](uint64_t h, int32_t b) {
    if (bad.empty() && (!cached_[b] || hash_[b] != h)) bad = "hash table entry for uncached block " + std::to_string(b);
  });
  return bad;
}

}  // namespace deepinfer

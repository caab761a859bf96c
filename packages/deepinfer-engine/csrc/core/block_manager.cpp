#include "core/block_manager.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/mix64.h"

namespace deepinfer {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
                           int32_t watermark_blocks, int32_t hash_bits)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      watermark_blocks_(watermark_blocks),
      hash_mask_(hash_bits >= 64 ? ~uint64_t{0} : ((uint64_t{1} << hash_bits) - 1)),
      meta_(static_cast<size_t>(num_blocks)),
      tokens_(enable_prefix_caching ? static_cast<size_t>(num_blocks) * block_size : 0),
      table_(enable_prefix_caching ? static_cast<size_t>(num_blocks) : 1) {
  free_stack_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_stack_.push_back(b);  // block 0 is used first
}

uint64_t BlockManager::host_bytes(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching) {
  const uint64_t n = static_cast<uint64_t>(num_blocks);
  uint64_t per_block = sizeof(BlockMeta) + sizeof(int32_t);  // metadata + free stack
  // Stored tokens, plus the hash table (capacity up to 4 entries per block, key + value each).
  if (enable_prefix_caching) per_block += static_cast<uint64_t>(block_size) * sizeof(int32_t) + 4 * 12;
  return n * per_block;
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
  return mix64(h) & hash_mask_;
}

uint64_t BlockManager::salt_seed(const std::string& salt) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a over the bytes, then the mix
  for (unsigned char c : salt) h = (h ^ c) * 0x100000001B3ull;
  h = mix64(h);
  return h ? h : 1;
}

void BlockManager::extend_hashes(std::vector<uint64_t>& hashes, const int32_t* tokens, int32_t num_tokens,
                                 uint64_t salt) const {
  const size_t full = static_cast<size_t>(num_tokens / block_size_);
  while (hashes.size() < full) {
    const size_t i = hashes.size();
    hashes.push_back(hash_block(i ? hashes[i - 1] : salt, tokens + i * block_size_));
  }
}

int32_t BlockManager::match_prefix(const std::vector<uint64_t>& hashes, const int32_t* tokens, int32_t max_blocks,
                                   std::vector<int32_t>& out, uint64_t salt) const {
  out.clear();
  if (!prefix_caching_) return 0;
  const int32_t n = std::min<int32_t>(max_blocks, static_cast<int32_t>(hashes.size()));
  int32_t prev = -1;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t c = table_.find(hashes[i]);
    if (c < 0) break;
    // Verify: the stored tokens and the chain (parent = the block matched for i-1).
    if (!meta_[c].cached || meta_[c].hash != hashes[i]) break;
    if (std::memcmp(&tokens_[static_cast<size_t>(c) * block_size_], tokens + static_cast<size_t>(i) * block_size_,
                    sizeof(int32_t) * block_size_) != 0)
      break;
    if (meta_[c].parent != prev || (prev >= 0 && meta_[c].parent_gen != meta_[prev].gen)) break;
    if (prev < 0 && meta_[c].salt != salt) break;  // another salt's chain (the hash alone may collide)
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
  for (int32_t i = 0; i < n; ++i) k += meta_[blocks[i]].ref == 0;
  return k;
}

void BlockManager::acquire(const int32_t* blocks, int32_t n, std::vector<int32_t>& table) {
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = blocks[i];
    if (meta_[b].ref == 0) lru_remove(b);
    ++meta_[b].ref;
    table.push_back(b);
  }
}

int32_t BlockManager::blocks_needed(const std::vector<int32_t>& table, int32_t num_written, int32_t num_slots) const {
  const int32_t size = static_cast<int32_t>(table.size());
  int32_t need = std::max(0, blocks_for(num_slots) - size);
  const int32_t idx = num_written / block_size_;
  if (num_slots > num_written && idx < size && meta_[table[idx]].ref > 1) ++need;  // copy-on-write
  return need;
}

bool BlockManager::ensure_slots(std::vector<int32_t>& table, int32_t num_written, int32_t num_slots,
                                std::vector<BlockCopy>& copies, bool* replaced) {
  const int32_t need = blocks_needed(table, num_written, num_slots);
  if (need == 0) return true;
  if (need > num_free_blocks()) return false;
  const int32_t idx = num_written / block_size_;
  if (num_slots > num_written && idx < static_cast<int32_t>(table.size()) && meta_[table[idx]].ref > 1) {
    const int32_t old = table[idx];
    const int32_t nb = alloc_block();
    if (num_written % block_size_ != 0) {  // the block holds KV that the copy must carry
      copies.push_back({old, nb});
      ++cow_copies_;
    }
    release(old);
    table[idx] = nb;
    if (replaced) *replaced = true;
  }
  const size_t want = static_cast<size_t>(blocks_for(num_slots));
  while (table.size() < want) table.push_back(alloc_block());
  return true;
}

bool BlockManager::trim(std::vector<int32_t>& table, int32_t num_slots) {
  const size_t keep = static_cast<size_t>(blocks_for(num_slots));
  const bool any = table.size() > keep;
  while (table.size() > keep) {
    release(table.back());
    table.pop_back();
  }
  return any;
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
    ++meta_[src[i]].ref;
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
    ++meta_[partial].ref;
    dst.push_back(partial);
  }
}

int32_t BlockManager::register_blocks(const std::vector<int32_t>& table, const std::vector<uint64_t>& hashes,
                                      const int32_t* tokens, int32_t first, int32_t last, uint64_t salt) {
  if (!prefix_caching_) return last;
  for (int32_t i = first; i < last; ++i) {
    const int32_t b = table[i];
    if (meta_[b].cached) continue;  // a hit, or shared with the sequence that registered it
    const int32_t prev = i ? table[i - 1] : -1;
    if (prev >= 0 && !meta_[prev].cached) continue;  // chain broken: this prefix cannot be verified
    if (!table_.insert(hashes[i], b)) continue;  // the same prefix (or a colliding one) already holds this hash
    meta_[b].cached = 1;
    meta_[b].hash = hashes[i];
    meta_[b].parent = prev;
    meta_[b].salt = prev >= 0 ? 0 : salt;
    meta_[b].parent_gen = prev >= 0 ? meta_[prev].gen : 0;
    std::memcpy(&tokens_[static_cast<size_t>(b) * block_size_], tokens + static_cast<size_t>(i) * block_size_,
                sizeof(int32_t) * block_size_);
    if (prev >= 0) {  // link as a cached child of prev
      meta_[b].next_sibling = meta_[prev].first_child;
      meta_[b].prev_sibling = -1;
      if (meta_[prev].first_child >= 0) meta_[meta_[prev].first_child].prev_sibling = b;
      meta_[prev].first_child = b;
    } else {
      meta_[b].next_sibling = meta_[b].prev_sibling = -1;
    }
    meta_[b].first_child = -1;
  }
  return last;
}

void BlockManager::reset_prefix_cache() {
  for (int32_t b = 0; b < num_blocks_; ++b)
    if (meta_[b].cached && meta_[b].parent < 0) uncache(b);  // cascades to every descendant
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
  meta_[b].ref = 1;
  return b;
}

void BlockManager::release(int32_t b) {
  if (--meta_[b].ref == 0) {
    if (meta_[b].cached) lru_push(b);
    else free_stack_.push_back(b);
  }
}

void BlockManager::lru_push(int32_t b) {
  meta_[b].lru_prev = lru_tail_;
  meta_[b].lru_next = -1;
  if (lru_tail_ >= 0) meta_[lru_tail_].lru_next = b;
  else lru_head_ = b;
  lru_tail_ = b;
  meta_[b].in_lru = 1;
  ++num_lru_;
}

void BlockManager::lru_remove(int32_t b) {
  const int32_t p = meta_[b].lru_prev, n = meta_[b].lru_next;
  if (p >= 0) meta_[p].lru_next = n;
  else lru_head_ = n;
  if (n >= 0) meta_[n].lru_prev = p;
  else lru_tail_ = p;
  meta_[b].lru_prev = meta_[b].lru_next = -1;
  meta_[b].in_lru = 0;
  --num_lru_;
}

// Takes b and every cached descendant out of the prefix cache. Free ones move from the LRU to
// the free stack (b itself last, so alloc_block can pop it).
void BlockManager::uncache(int32_t root) {
  // Unlink root from its parent's child list.
  const int32_t p = meta_[root].parent;
  if (p >= 0) {
    if (meta_[root].prev_sibling >= 0) meta_[meta_[root].prev_sibling].next_sibling = meta_[root].next_sibling;
    else meta_[p].first_child = meta_[root].next_sibling;
    if (meta_[root].next_sibling >= 0) meta_[meta_[root].next_sibling].prev_sibling = meta_[root].prev_sibling;
  }
  uncache_stack_.clear();
  uncache_stack_.push_back(root);
  std::vector<int32_t>& order = uncache_order_;  // root first
  order.clear();
  while (!uncache_stack_.empty()) {
    const int32_t b = uncache_stack_.back();
    uncache_stack_.pop_back();
    order.push_back(b);
    for (int32_t c = meta_[b].first_child; c >= 0; c = meta_[c].next_sibling) uncache_stack_.push_back(c);
  }
  // Descendants first onto the free stack, root last (on top).
  for (size_t i = order.size(); i-- > 0;) {
    const int32_t b = order[i];
    table_.erase(meta_[b].hash, b);
    meta_[b].cached = 0;
    ++meta_[b].gen;
    meta_[b].parent = -1;
    meta_[b].first_child = meta_[b].next_sibling = meta_[b].prev_sibling = -1;
    if (meta_[b].in_lru) {
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
    if (meta_[b].cached) return "cached block " + std::to_string(b) + " on the uncached free stack";
  }
  int32_t n_lru = 0;
  for (int32_t b = lru_head_; b >= 0; b = meta_[b].lru_next) {
    if (seen[b]++) return "block " + std::to_string(b) + " free twice (LRU)";
    if (!meta_[b].cached) return "uncached block " + std::to_string(b) + " in the LRU";
    if (++n_lru > num_blocks_) return "LRU cycle";
  }
  if (n_lru != num_lru_) return "LRU count mismatch";
  int32_t used = 0;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (meta_[b].ref != owners[b])
      return "block " + std::to_string(b) + ": ref count " + std::to_string(meta_[b].ref) + " != owners " +
             std::to_string(owners[b]);
    if (meta_[b].ref > 0 && seen[b]) return "block " + std::to_string(b) + " both used and free";
    if (meta_[b].ref == 0 && !seen[b]) return "block " + std::to_string(b) + " leaked (unowned, not free)";
    used += meta_[b].ref > 0;
    if (meta_[b].cached) {
      if (table_.find(meta_[b].hash) != b) return "cached block " + std::to_string(b) + " not in the hash table";
      if (meta_[b].parent >= 0 && (!meta_[meta_[b].parent].cached || meta_[meta_[b].parent].gen != meta_[b].parent_gen))
        return "cached block " + std::to_string(b) + " has a stale parent";
    }
  }
  if (used + num_free_blocks() != num_blocks_) return "free + used != total";
  std::string bad;
  table_.for_each([&](uint64_t h, int32_t b) {
    if (bad.empty() && (!meta_[b].cached || meta_[b].hash != h)) bad = "hash table entry for uncached block " + std::to_string(b);
  });
  return bad;
}

}  // namespace deepinfer

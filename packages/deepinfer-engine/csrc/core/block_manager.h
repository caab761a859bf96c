// Paged KV cache bookkeeping: ref-counted blocks, prefix caching, LRU eviction, copy-on-write.
//
// Prefix caching: a full block is registered under a chained hash h_i = H(h_{i-1}, tokens of
// block i). A hit is served only after verifying the candidate block's stored tokens AND its
// stored parent (block id + generation) against the block already matched at i-1, so a hash
// collision can never serve another prefix's KV. A block is registered only when the block
// before it in the same table is registered (or it is block 0) and no block holds its hash yet;
// when a block leaves the cache, its cached descendants leave too, so a cached block's parent is
// always cached: one registered block per prefix, every chain verifiable from block 0.
// Cache salt (vLLM's cache_salt): a request's salt seeds block 0's hash (parent = salt seed
// instead of 0) and is stored with block 0 and verified on a hit, so requests of different salts
// never share KV, even under a forced hash collision; later blocks inherit it through the chain.
// Free blocks: uncached ones on a stack (used first), cached ones in an LRU list (evicted
// oldest-first; a sequence's blocks are freed last block first, so prefixes live longest).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/block_hash_table.h"

namespace deepinfer {

using BlockCopy = std::array<int32_t, 2>;  // (src block, dst block)

struct BlockManagerStats {
  int32_t num_blocks = 0;
  int32_t num_free_blocks = 0;    // uncached free + cached free (evictable)
  int32_t num_cached_blocks = 0;  // registered in the prefix cache (free or in use)
  int64_t prefix_queries = 0;     // tokens looked up at admissions
  int64_t prefix_hits = 0;        // of which served from the cache
  int64_t num_evictions = 0;
  int64_t num_cow_copies = 0;
};

class BlockManager {
 public:
  // hash_bits < 64 masks every hash to that many bits (test hook: certain collisions).
  BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching,
               int32_t watermark_blocks, int32_t hash_bits = 64);

  // Host memory the constructor allocates for these sizes (per-block metadata, free stack,
  // prefix-cache tokens and hash table): callers bound it before constructing.
  static uint64_t host_bytes(int64_t num_blocks, int64_t block_size, bool enable_prefix_caching);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int32_t watermark_blocks() const { return watermark_blocks_; }
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_stack_.size()) + num_lru_; }
  int32_t ref_count(int32_t b) const { return meta_[b].ref; }
  void prefetch_block(int32_t b) const { __builtin_prefetch(&meta_[b]); }
  bool is_cached(int32_t b) const { return meta_[b].cached != 0; }
  int32_t blocks_for(int32_t num_slots) const { return (num_slots + block_size_ - 1) / block_size_; }

  // Chained hash of one block (masked to hash_bits).
  uint64_t hash_block(uint64_t parent_hash, const int32_t* tokens) const;
  // The seed of a cache salt (never 0, which is "unsalted"). It need not be a cryptographic
  // hash: a request shares cached KV with another salt only if the two seeds are equal, and the
  // seed is never shown, so a client that does not know a salt must guess 64 bits, one request
  // per guess.
  static uint64_t salt_seed(const std::string& salt);
  // Extends `hashes` to cover every full block of tokens[0, num_tokens); `salt` (0: none) is
  // block 0's parent hash.
  void extend_hashes(std::vector<uint64_t>& hashes, const int32_t* tokens, int32_t num_tokens,
                     uint64_t salt = 0) const;

  // Longest verified cached prefix of tokens (at most max_blocks blocks) registered under the
  // same `salt`; fills `out` with the block ids (not acquired).
  int32_t match_prefix(const std::vector<uint64_t>& hashes, const int32_t* tokens, int32_t max_blocks,
                       std::vector<int32_t>& out, uint64_t salt = 0) const;
  void record_lookup(int64_t queried_tokens, int64_t hit_tokens);

  // Number of free blocks that acquiring these hit blocks takes out of the free pool.
  int32_t num_free_among(const int32_t* blocks, int32_t n) const;
  // Takes a reference on each block (hits); cached free blocks leave the LRU list.
  void acquire(const int32_t* blocks, int32_t n, std::vector<int32_t>& table);

  // New blocks needed so that `table` covers num_slots slots, plus 1 when the last block is a
  // shared partial block that the next write must copy (copy-on-write).
  int32_t blocks_needed(const std::vector<int32_t>& table, int32_t num_written, int32_t num_slots) const;
  // Grows `table` to cover num_slots slots and performs copy-on-write of a shared partial last
  // block (num_written = slots already holding KV). Returns false, changing nothing, when there
  // are not enough free blocks. *replaced (when given) is set to true when an existing entry of
  // `table` was replaced (copy-on-write), not only appended to: the caller must touch the
  // sequence's block_table_version then.
  bool ensure_slots(std::vector<int32_t>& table, int32_t num_written, int32_t num_slots,
                    std::vector<BlockCopy>& copies, bool* replaced = nullptr);
  // Drops trailing blocks beyond num_slots (rollback of rejected speculative slots). Returns
  // whether any was dropped.
  bool trim(std::vector<int32_t>& table, int32_t num_slots);
  // Releases every block of `table` (last first) and clears it.
  void free_table(std::vector<int32_t>& table);
  // Fork: dst shares the full blocks of src covering num_written slots (ref counts + 1) and gets
  // a copy of the partial last block (appended to `copies`); when no block is free it shares that
  // block too and the next write copies it (copy-on-write in ensure_slots).
  void fork_table(const std::vector<int32_t>& src, int32_t num_written, std::vector<int32_t>& dst,
                  std::vector<BlockCopy>& copies);

  // Registers the full, computed blocks [first, last) of `table` (hashes/tokens of the sequence,
  // whose cache salt is `salt`) in the prefix cache; returns the new count of leading registered
  // blocks.
  int32_t register_blocks(const std::vector<int32_t>& table, const std::vector<uint64_t>& hashes,
                          const int32_t* tokens, int32_t first, int32_t last, uint64_t salt = 0);

  // Forgets every cached block (their KV is no longer reusable). Always succeeds.
  void reset_prefix_cache();

  BlockManagerStats stats() const;
  // Test hook: full consistency check; returns "" or a description of the first violation.
  std::string check_consistency(const std::vector<const std::vector<int32_t>*>& tables) const;

 private:
  int32_t alloc_block();  // from the free stack, else evicts the LRU cached block
  void release(int32_t b);
  void lru_push(int32_t b);
  void lru_remove(int32_t b);
  void uncache(int32_t b);

  int32_t num_blocks_, block_size_;
  bool prefix_caching_;
  int32_t watermark_blocks_;
  uint64_t hash_mask_;

  // Everything the manager knows about a block, in one cache line: a step touches a block's
  // ref count, cache state, chain and LRU links together.
  struct alignas(64) BlockMeta {
    uint64_t hash = 0;
    uint64_t salt = 0;         // block 0 of a chain: its request's cache salt seed (0: none)
    int32_t ref = 0;
    uint32_t gen = 0;          // bumped every time the block leaves the cache
    int32_t parent = -1;       // block matched before it in its chain (-1 for block 0)
    uint32_t parent_gen = 0;   // the parent's gen when registered
    int32_t lru_prev = -1, lru_next = -1;  // LRU of cached free blocks (head = oldest)
    int32_t first_child = -1, next_sibling = -1, prev_sibling = -1;  // cached children
    uint8_t cached = 0, in_lru = 0;
  };
  std::vector<BlockMeta> meta_;
  std::vector<int32_t> free_stack_;
  std::vector<int32_t> tokens_;  // num_blocks * block_size stored tokens of cached blocks
  BlockHashTable table_;
  int32_t lru_head_ = -1, lru_tail_ = -1, num_lru_ = 0;
  std::vector<int32_t> uncache_stack_, uncache_order_;

  int64_t prefix_queries_ = 0, prefix_hits_ = 0, evictions_ = 0, cow_copies_ = 0;
};

}  // namespace deepinfer

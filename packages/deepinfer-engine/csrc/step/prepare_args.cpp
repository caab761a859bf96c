#include "step/prepare_args.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/invalid_argument.h"

namespace deepinfer {

namespace {

[[noreturn]] void fail(const char* name, const std::string& what) { throw InvalidArgument(name, what); }

template <class T>
void require_capacity(const buf::Buf1D<T>& b, const char* name, size_t min_size) {
  if (b.size < min_size)
    fail(name, "capacity " + std::to_string(b.size) + " < required " + std::to_string(min_size));
}

}  // namespace

PrepareArgs::PrepareArgs(int32_t block_size_, int32_t max_model_len_, std::vector<int32_t> graph_batch_sizes_,
                         YocoPrefillTruncationMode yoco_mode_, EngramConfig engram_, const PrepareBuffers& b)
    : block_size(block_size_),
      max_model_len(max_model_len_),
      graph_batch_sizes(std::move(graph_batch_sizes_)),
      yoco_mode(yoco_mode_),
      engram(std::move(engram_)) {
  if (block_size < 1) fail("block_size", "must be >= 1, got " + std::to_string(block_size));
  if (max_model_len < 1) fail("max_model_len", "must be >= 1, got " + std::to_string(max_model_len));
  engram.validate();
  // An enum read from an integer may hold any value (YocoPrefillTruncationMode(7)).
  if (static_cast<int>(yoco_mode) > static_cast<int>(YocoPrefillTruncationMode::LOGITS_ROWS))
    fail("yoco_mode", "must be NONE, LAST_TOKEN or LOGITS_ROWS, got " + std::to_string(static_cast<int>(yoco_mode)));
  // Capacities come from input_ids (tokens) and block_tables (sequences, width).
  require_capacity(b.input_ids, "input_ids", 1);
  input_ids = b.input_ids;
  max_num_tokens = input_ids.size;
  if (b.block_tables.rows < 1)
    fail("block_tables", std::to_string(b.block_tables.rows) + " rows < required 1 (shape " +
                             buf::shape_str(b.block_tables) + ")");
  block_tables = b.block_tables;
  max_num_seqs = block_tables.rows;
  max_blocks_per_seq = block_tables.cols;
  if (max_blocks_per_seq < 1) fail("block_tables", "needs at least one column");
  require_capacity(b.positions, "positions", max_num_tokens);
  require_capacity(b.slot_mapping, "slot_mapping", max_num_tokens);
  require_capacity(b.query_start_loc, "query_start_loc", max_num_seqs + 1);
  require_capacity(b.seq_lens, "seq_lens", max_num_seqs);
  require_capacity(b.logits_indices, "logits_indices", max_num_tokens);
  positions = b.positions;
  slot_mapping = b.slot_mapping;
  query_start_loc = b.query_start_loc;
  seq_lens = b.seq_lens;
  logits_indices = b.logits_indices;
  if (yoco_mode != YocoPrefillTruncationMode::NONE) {
    if (!b.yoco_kept_rows.data) fail("yoco_kept_rows", "required when yoco_mode is not NONE");
    if (!b.yoco_cu_seqlens.data) fail("yoco_cu_seqlens", "required when yoco_mode is not NONE");
    require_capacity(b.yoco_kept_rows, "yoco_kept_rows", max_num_tokens);
    require_capacity(b.yoco_cu_seqlens, "yoco_cu_seqlens", max_num_seqs + 1);
    yoco_kept_rows = b.yoco_kept_rows;
    yoco_cu_seqlens = b.yoco_cu_seqlens;
  }
  if (engram.enabled()) {
    if (!b.engram_indices.data) fail("engram_indices", "required when engram_ngram_orders is set");
    const buf::Buf2D<int32_t>& e = b.engram_indices;
    if (e.rows < max_num_tokens)
      fail("engram_indices", std::to_string(e.rows) + " rows < required " + std::to_string(max_num_tokens) +
                                 " (shape " + buf::shape_str(e) + ")");
    if (e.cols != engram.num_columns())
      fail("engram_indices", "expected " + std::to_string(engram.num_columns()) + " columns, got shape " +
                                 buf::shape_str(e));
    engram_indices = e;
  }
  if (b.zos_source_index.data) {
    require_capacity(b.zos_source_index, "zos_source_index", max_num_tokens);
    zos_source_index = b.zos_source_index;
  }

  std::sort(graph_batch_sizes.begin(), graph_batch_sizes.end());
  graph_batch_sizes.erase(std::unique(graph_batch_sizes.begin(), graph_batch_sizes.end()), graph_batch_sizes.end());
  for (int32_t g : graph_batch_sizes) {
    if (g < 1 || static_cast<size_t>(g) > max_num_seqs)
      fail("graph_batch_sizes", "each size must be in [1, block_tables rows = " + std::to_string(max_num_seqs) +
                                    "], got " + std::to_string(g));
  }
  // Block-table rows are written incrementally from a known state: all zero.
  std::memset(block_tables.data, 0, sizeof(int32_t) * block_tables.rows * block_tables.cols);
  // Per-row arrays at full size now: they never move, so a row_seq_ids view never dangles.
  layout.ensure(max_num_seqs, 0);
  bt_seq_id.assign(max_num_seqs, -1);
  bt_len.assign(max_num_seqs, 0);
  bt_version.assign(max_num_seqs, 0);
}

int32_t PrepareArgs::padded_batch_size(int32_t n) const {
  auto it = std::lower_bound(graph_batch_sizes.begin(), graph_batch_sizes.end(), n);
  return it == graph_batch_sizes.end() ? n : *it;
}

}  // namespace deepinfer

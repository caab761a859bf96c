#include "prepare_args.h"

#include <algorithm>
#include <cstring>

namespace deepinfer {

namespace py = pybind11;

PrepareArgs::PrepareArgs(int32_t block_size_, int32_t max_model_len_, std::vector<int32_t> graph_batch_sizes_,
                         YocoPrefillTruncationMode yoco_mode_, EngramConfig engram_, const py::object& input_ids_,
                         const py::object& positions_, const py::object& slot_mapping_,
                         const py::object& query_start_loc_, const py::object& seq_lens_,
                         const py::object& block_tables_, const py::object& logits_indices_,
                         const py::object& yoco_kept_rows_, const py::object& yoco_cu_seqlens_,
                         const py::object& engram_indices_, const py::object& zos_source_index_)
    : block_size(block_size_),
      max_model_len(max_model_len_),
      graph_batch_sizes(std::move(graph_batch_sizes_)),
      yoco_mode(yoco_mode_),
      engram(std::move(engram_)) {
  if (block_size < 1) buf::fail("block_size", "must be >= 1, got " + std::to_string(block_size));
  if (max_model_len < 1) buf::fail("max_model_len", "must be >= 1, got " + std::to_string(max_model_len));
  try {
    engram.validate();
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  // pybind11 enums accept any int (YocoPrefillTruncationMode(7)); refuse values with no meaning.
  if (static_cast<int>(yoco_mode) > static_cast<int>(YocoPrefillTruncationMode::LOGITS_ROWS))
    buf::fail("yoco_mode", "must be NONE, LAST_TOKEN or LOGITS_ROWS, got " + std::to_string(static_cast<int>(yoco_mode)));
  // Capacities come from input_ids (tokens) and block_tables (sequences, width).
  input_ids = buf::check_1d<int32_t>(input_ids_, "input_ids", 1);
  max_num_tokens = input_ids.size;
  block_tables = buf::check_2d<int32_t>(block_tables_, "block_tables", 1, -1);
  max_num_seqs = block_tables.rows;
  max_blocks_per_seq = block_tables.cols;
  if (max_blocks_per_seq < 1) buf::fail("block_tables", "needs at least one column");
  positions = buf::check_1d<int32_t>(positions_, "positions", max_num_tokens);
  slot_mapping = buf::check_1d<int64_t>(slot_mapping_, "slot_mapping", max_num_tokens);
  query_start_loc = buf::check_1d<int32_t>(query_start_loc_, "query_start_loc", max_num_seqs + 1);
  seq_lens = buf::check_1d<int32_t>(seq_lens_, "seq_lens", max_num_seqs);
  logits_indices = buf::check_1d<int32_t>(logits_indices_, "logits_indices", max_num_tokens);
  if (yoco_mode != YocoPrefillTruncationMode::NONE) {
    if (yoco_kept_rows_.is_none()) buf::fail("yoco_kept_rows", "required when yoco_mode is not NONE");
    if (yoco_cu_seqlens_.is_none()) buf::fail("yoco_cu_seqlens", "required when yoco_mode is not NONE");
    yoco_kept_rows = buf::check_1d<int32_t>(yoco_kept_rows_, "yoco_kept_rows", max_num_tokens);
    yoco_cu_seqlens = buf::check_1d<int32_t>(yoco_cu_seqlens_, "yoco_cu_seqlens", max_num_seqs + 1);
  }
  if (engram.enabled()) {
    if (engram_indices_.is_none()) buf::fail("engram_indices", "required when engram_ngram_orders is set");
    engram_indices = buf::check_2d<int32_t>(engram_indices_, "engram_indices", max_num_tokens,
                                            static_cast<long>(engram.num_columns()));
  }
  if (!zos_source_index_.is_none())
    zos_source_index = buf::check_1d<int32_t>(zos_source_index_, "zos_source_index", max_num_tokens);

  std::sort(graph_batch_sizes.begin(), graph_batch_sizes.end());
  graph_batch_sizes.erase(std::unique(graph_batch_sizes.begin(), graph_batch_sizes.end()), graph_batch_sizes.end());
  for (int32_t g : graph_batch_sizes) {
    if (g < 1 || static_cast<size_t>(g) > max_num_seqs)
      buf::fail("graph_batch_sizes", "each size must be in [1, block_tables rows = " + std::to_string(max_num_seqs) +
                                         "], got " + std::to_string(g));
  }
  // Only validated buffers are kept (a buffer of a disabled feature is ignored).
  const bool yoco = yoco_mode != YocoPrefillTruncationMode::NONE;
  owners = {input_ids_,
            positions_,
            slot_mapping_,
            query_start_loc_,
            seq_lens_,
            block_tables_,
            logits_indices_,
            yoco ? yoco_kept_rows_ : py::none(),
            yoco ? yoco_cu_seqlens_ : py::none(),
            engram.enabled() ? engram_indices_ : py::none(),
            zos_source_index_};
  // Block-table rows are written incrementally from a known state: all zero.
  std::memset(block_tables.data, 0, sizeof(int32_t) * block_tables.rows * block_tables.cols);
  // Per-row arrays at full size now: they never move, so a row_seq_ids view never dangles.
  layout.ensure(max_num_seqs, 0);
  bt_seq_id.assign(max_num_seqs, -1);
  bt_len.assign(max_num_seqs, 0);
  bt_version.assign(max_num_seqs, 0);
}

void PrepareArgs::recheck_writable() const {
  static const char* const names[] = {"input_ids",      "positions",      "slot_mapping",   "query_start_loc",
                                      "seq_lens",       "block_tables",   "logits_indices", "yoco_kept_rows",
                                      "yoco_cu_seqlens", "engram_indices", "zos_source_index"};
  for (size_t i = 0; i < owners.size(); ++i) {
    if (owners[i].is_none()) continue;
    if (!py::reinterpret_borrow<py::array>(owners[i]).writeable())
      buf::fail(names[i], "became read-only after PrepareArgs was built");
  }
}

int32_t PrepareArgs::padded_batch_size(int32_t n) const {
  auto it = std::lower_bound(graph_batch_sizes.begin(), graph_batch_sizes.end(), n);
  return it == graph_batch_sizes.end() ? n : *it;
}

}  // namespace deepinfer

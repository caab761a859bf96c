// PrepareArgs: static configuration of model-input preparation plus the persistent borrowed
// output buffers the builders write, and the layout of the last prepared step (which rows,
// logits rows and sequences it had), read by the sampler-input and update calls.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "buffer_check.h"
#include "busy_flag.h"
#include "engram.h"
#include "yoco.h"

namespace deepinfer {

// What a logits row is for.
enum class LogitsRowKind : uint8_t { SAMPLE = 0, PROMPT_LOGPROB = 1, PAD = 2 };

struct StepLayout {
  // Per batch row (real rows first, then padding rows).
  std::vector<int32_t> row_token_offset;  // first flattened token row
  std::vector<int32_t> row_num_tokens;
  std::vector<int32_t> row_logits_offset;  // first logits row
  std::vector<int32_t> row_num_logits;
  // Per logits row: the batch row it belongs to, its kind and the position whose logits it holds.
  std::vector<int32_t> logit_row;
  std::vector<LogitsRowKind> logit_kind;
  std::vector<int32_t> logit_position;
  // ZOS: per real batch row, the seq_id (placeholders: -1); rows discarded so far.
  std::vector<int64_t> row_seq_id;
  std::vector<int32_t> row_zos_src;  // ZOS: step-N logits row of the pending input token, else -1
  int32_t num_tokens = 0, num_real_rows = 0, num_rows = 0, num_logits = 0, num_yoco_rows = 0;
  // Logits rows of kind PROMPT_LOGPROB (kept by set_logit and zos_discard): lets the sampler-input
  // build skip its walks over the logits rows in the usual step, which has none.
  int32_t num_prompt_logprob_rows = 0;
  uint64_t pool_generation = 0;  // the SequenceMetadataPool generation it was built from
  bool zos = false;
  // Counts only: the vectors keep their size (grow-only, written by index) so a step does no
  // allocation and no per-element bookkeeping.
  void clear() {
    num_tokens = num_real_rows = num_rows = num_logits = num_yoco_rows = num_prompt_logprob_rows = 0;
    zos = false;
  }
  void ensure(size_t rows, size_t logits) {
    if (row_token_offset.size() < rows) {
      for (auto* v : {&row_token_offset, &row_num_tokens, &row_logits_offset, &row_num_logits, &row_zos_src})
        v->resize(rows);
      row_seq_id.resize(rows);
    }
    if (logit_row.size() < logits) {
      logit_row.resize(logits);
      logit_kind.resize(logits);
      logit_position.resize(logits);
    }
  }
  void set_logit(int32_t k, int32_t row, LogitsRowKind kind, int32_t position) {
    logit_row[k] = row;
    logit_kind[k] = kind;
    num_prompt_logprob_rows += kind == LogitsRowKind::PROMPT_LOGPROB;
    logit_position[k] = position;
  }
};

class PrepareArgs {
 public:
  // Validates everything (raising Python exceptions naming the argument); zero-fills block_tables.
  PrepareArgs(int32_t block_size, int32_t max_model_len, std::vector<int32_t> graph_batch_sizes,
              YocoPrefillTruncationMode yoco_mode, EngramConfig engram, const pybind11::object& input_ids,
              const pybind11::object& positions, const pybind11::object& slot_mapping,
              const pybind11::object& query_start_loc, const pybind11::object& seq_lens,
              const pybind11::object& block_tables, const pybind11::object& logits_indices,
              const pybind11::object& yoco_kept_rows, const pybind11::object& yoco_cu_seqlens,
              const pybind11::object& engram_indices, const pybind11::object& zos_source_index);

  int32_t block_size, max_model_len;
  std::vector<int32_t> graph_batch_sizes;  // sorted ascending
  YocoPrefillTruncationMode yoco_mode;
  EngramConfig engram;
  size_t max_num_tokens = 0, max_num_seqs = 0, max_blocks_per_seq = 0;

  // Borrowed buffers (the py::objects keep them alive).
  buf::Buf1D<int32_t> input_ids, positions, query_start_loc, seq_lens, logits_indices;
  buf::Buf1D<int64_t> slot_mapping;
  buf::Buf2D<int32_t> block_tables;
  buf::Buf1D<int32_t> yoco_kept_rows, yoco_cu_seqlens, zos_source_index;
  buf::Buf2D<int32_t> engram_indices;
  std::vector<pybind11::object> owners;  // input_ids, ..., in constructor order (None when absent)

  // Incremental block tables: per row, the sequence written there and how many entries are
  // non-zero (entries beyond are zero).
  std::vector<int64_t> bt_seq_id;
  std::vector<int32_t> bt_len;
  std::vector<uint64_t> bt_version;  // Sequence::block_table_version when written (0: unknown)
  int64_t num_block_rows_written = 0;  // statistics: rows (re)written, for tests/benchmarks

  StepLayout layout;
  mutable BusyFlag busy;  // taken by the builders and zos_discard (busy_flag.h)

  // Re-checks (GIL held) that no buffer was made read-only since construction.
  void recheck_writable() const;

  // Smallest graph batch size >= n, or n when none is (eager step).
  int32_t padded_batch_size(int32_t n) const;
};

}  // namespace deepinfer

namespace deepinfer {

class SequenceMetadataPool;

enum class BuildMode : uint8_t { PROMPT, DECODE, ZOS, DECODE_ZOS };

// Builds one step's model inputs into a's buffers and a.layout. Validates every row first and
// throws (pybind11 value_error / type_error) before writing anything. Needs no GIL.
// ZOS modes: `prev` is the PrepareArgs of step N (may be `a` itself); rows of sequences that
// sampled in step N take their input token from step N's sampled-token tensor.
int32_t prepare_inputs(PrepareArgs& a, SequenceMetadataPool& pool, BuildMode mode, const PrepareArgs* prev);

// ZOS: turns the rows of `finished_seq_ids` in a's last layout into placeholders (slots -1,
// no sampling); appends their batch rows and logits rows to the outputs.
void zos_discard(PrepareArgs& a, const int64_t* finished_seq_ids, size_t n, std::vector<int32_t>& batch_rows,
                 std::vector<int32_t>& logits_rows);

}  // namespace deepinfer

// prepare_prompt_v4 / prepare_decode_v4 / the ZOS variants: the flattened var-len layout.
#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>

#include "core/invalid_argument.h"
#include "step/engram.h"
#include "step/metadata.h"
#include "step/prepare_args.h"

namespace deepinfer {

namespace {

[[noreturn]] void row_error(size_t i, const std::string& what) {
  throw InvalidArgument("metadata[" + std::to_string(i) + "]", what);
}

// Per metadata row, the effective step range (ZOS pending rows: one token at position L).
struct RowPlan {
  int32_t start, num, src;  // src: step-N logits row of the pending input token, -1 when host-known
  bool placeholder = false;  // aborted after schedule(): its blocks are gone, so it writes nowhere
  // Gathered by the validation pass (which reads the Sequence anyway) so the write pass of a
  // one-token row touches no Sequence, token or block-table memory: its input token and slot,
  // and what the block-table row is written from.
  int32_t token = 0, nb = 0;
  int64_t slot = -1, seq_id = -1;
  const int32_t* bt = nullptr;
  uint64_t version = 0;
};

// The sequence's block-table version when the store keeps one (0: unknown -> compare contents).
template <class S>
uint64_t block_table_version(const S& s) {
  if constexpr (requires { s.block_table_version; }) return static_cast<uint64_t>(s.block_table_version);
  else return 0;
}

// Writes the block-table row `r` for `seq` (rewriting only entries that changed).
void write_block_row(PrepareArgs& a, size_t r, int64_t seq_id, const int32_t* blocks, int32_t nb, uint64_t version) {
  int32_t* row = a.block_tables.row(r);
  const int32_t old = a.bt_len[r];
  const bool same_seq = a.bt_seq_id[r] == seq_id;
  // Same nonzero version as when this row was written: by the contract of
  // Sequence::block_table_version its first `old` entries are unchanged, only appends are new
  // (no memcmp). A shorter table with the same version breaks the contract: rewrite it below.
  if (version != 0 && same_seq && a.bt_version[r] == version && nb >= old) {
    if (nb > old) {
      std::memcpy(row + old, blocks + old, sizeof(int32_t) * (nb - old));
      a.bt_len[r] = nb;
      ++a.num_block_rows_written;
    }
    return;
  }
  a.bt_version[r] = version;
  // Unknown (0) or changed version: compare contents, so an unchanged prefix still costs no write.
  // (memcmp/memcpy need non-null pointers even for 0 bytes: placeholder rows pass nb = 0.)
  if (same_seq && old <= nb && (old == 0 || std::memcmp(row, blocks, sizeof(int32_t) * old) == 0)) {
    if (nb > old) {
      std::memcpy(row + old, blocks + old, sizeof(int32_t) * (nb - old));
      a.bt_len[r] = nb;
      ++a.num_block_rows_written;
    }
    return;
  }
  if (nb > 0) std::memcpy(row, blocks, sizeof(int32_t) * nb);
  if (old > nb) std::memset(row + nb, 0, sizeof(int32_t) * (old - nb));
  a.bt_seq_id[r] = seq_id;
  a.bt_len[r] = nb;
  ++a.num_block_rows_written;
}

}  // namespace

int32_t prepare_inputs(PrepareArgs& a, SequenceMetadataPool& pool, BuildMode mode, const PrepareArgs* prev) {
  const bool zos = mode == BuildMode::ZOS || mode == BuildMode::DECODE_ZOS;
  const bool decode_only = mode == BuildMode::DECODE || mode == BuildMode::DECODE_ZOS;
  pool.resolve();
  const size_t n = pool.size();
  if (n > a.max_num_seqs)
    throw InvalidArgument("metadata", std::to_string(n) + " sequences > block_tables rows " +
                          std::to_string(a.max_num_seqs));
  if (zos) {
    if (!a.zos_source_index.data) throw InvalidArgument("zos_source_index", "PrepareArgs was built without it (needed by the ZOS builders)");
    if (a.engram.enabled()) throw InvalidArgument("engram", "the ZOS builders cannot hash tokens still on the device; use the synchronous builders");
  }
  std::shared_ptr<const EngramTable> etable;
  if (a.engram.enabled()) {
    etable = engram_table();
    if (!etable) throw InvalidArgument("engram", "no lookup table installed (call set_engram_lookup_table)");
  }

  thread_local std::vector<RowPlan> plan_storage;
  plan_storage.resize(n);
  RowPlan* const plan = plan_storage.data();  // (one TLS lookup, not one per row)
  // Block index and offset of a position: shifts when block_size is a power of two (the usual
  // case; a division per row costs more than the rest of a decode row's work).
  const int32_t bs = a.block_size;
  const int bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctz(static_cast<unsigned>(bs)) : -1;
  auto block_of = [bs, bs_shift](int32_t pos) { return bs_shift >= 0 ? pos >> bs_shift : pos / bs; };
  auto offset_in_block = [bs, bs_shift](int32_t pos) { return bs_shift >= 0 ? pos & (bs - 1) : pos % bs; };
  // ZOS: seq_id -> step N logits row of its SAMPLE token (the last one of its row), or -1.
  // Rows usually keep their order from step to step: try the next row of step N first and
  // build a hash map only when the order changed.
  thread_local std::unordered_map<int64_t, int32_t> prev_rows;
  thread_local std::vector<int32_t> prev_sample;  // per step-N row: its SAMPLE logits row or -1
  bool prev_map_built = false;
  int32_t hint = 0;
  auto prev_row_of = [&](int64_t seq_id) -> int32_t {
    const StepLayout& pl = prev->layout;
    if (hint < pl.num_real_rows && pl.row_seq_id[hint] == seq_id) return prev_sample[hint++];
    if (!prev_map_built) {
      prev_rows.clear();
      for (int32_t r = 0; r < pl.num_real_rows; ++r)
        if (pl.row_seq_id[r] >= 0) prev_rows[pl.row_seq_id[r]] = r;
      prev_map_built = true;
    }
    auto it = prev_rows.find(seq_id);
    if (it == prev_rows.end()) return -1;
    hint = it->second + 1;
    return prev_sample[it->second];
  };
  if (zos) {
    const StepLayout& pl = prev->layout;
    prev_sample.assign(pl.num_real_rows, -1);
    for (int32_t r = 0; r < pl.num_real_rows; ++r) {
      if (pl.row_seq_id[r] < 0 || pl.row_num_logits[r] == 0) continue;
      const int32_t last = pl.row_logits_offset[r] + pl.row_num_logits[r] - 1;
      if (pl.logit_kind[last] == LogitsRowKind::SAMPLE) prev_sample[r] = last;
    }
  }

  // ---- Validation pass: nothing is written until every row is known to fit. ----
  int64_t total = 0;
  int32_t max_q = 1;
  for (size_t i = 0; i < n; ++i) {
    const MetadataRow& r = pool[i];
    const Sequence& s = *r.seq;
    const int32_t L = s.num_tokens();
    RowPlan p{r.start, r.num_new, -1};
    // A sequence finished after schedule() (abort_request, stop_sequence) has its blocks freed
    // at once; its row keeps its token count but becomes a placeholder (slot -1, seq id -1) so
    // the other rows still build. update/process_MTPInfo skip it the same way.
    if (is_finished(s.status)) {
      if (decode_only && r.is_prompt) row_error(i, "is a prompt chunk; prepare_decode_v4 takes decode rows only (use prepare_prompt_v4)");
      p = {0, std::max(1, r.num_new), -1, true};
      RowPlan& out = plan[i];
      out.start = p.start;
      out.num = p.num;
      out.src = p.src;
      out.placeholder = true;
      total += p.num;
      max_q = std::max(max_q, p.num);
      continue;
    }
    if (zos && !r.is_prompt) {
      const int32_t src = prev_row_of(s.seq_id);
      if (src >= 0) p = {L, 1, src};
    }
    if (decode_only && r.is_prompt) row_error(i, "is a prompt chunk; prepare_decode_v4 takes decode rows only (use prepare_prompt_v4)");
    if (p.num < 1) row_error(i, "num_new_tokens must be >= 1, got " + std::to_string(p.num));
    if (p.src < 0) {
      // (num_drafts 0 always fits: draft_tokens, on another cache line, is read only when needed.)
      if (r.num_drafts != 0 && (r.num_drafts < 0 || static_cast<size_t>(r.num_drafts) > s.draft_tokens.size()))
        row_error(i, "num_drafts " + std::to_string(r.num_drafts) + " > stored draft tokens " +
                         std::to_string(s.draft_tokens.size()));
      if (p.start < 0 || p.start + p.num > L + r.num_drafts)
        row_error(i, "token range [" + std::to_string(p.start) + ", " + std::to_string(p.start + p.num) +
                         ") exceeds the sequence's " + std::to_string(L) + " tokens + " + std::to_string(r.num_drafts) +
                         " drafts");
      if (r.num_drafts > 0 && p.start + p.num - r.num_drafts != L)
        row_error(i, "a speculative row must end with its drafts right after the last token");
    }
    const int32_t ctx = p.start + p.num;
    if (ctx > a.max_model_len)
      row_error(i, "context length " + std::to_string(ctx) + " > max_model_len " + std::to_string(a.max_model_len));
    const int32_t need_blocks = block_of(ctx - 1) + 1;  // ctx >= 1
    if (static_cast<size_t>(need_blocks) > s.block_table.size())
      row_error(i, "block table has " + std::to_string(s.block_table.size()) + " blocks, " +
                       std::to_string(need_blocks) + " needed for " + std::to_string(ctx) + " tokens");
    if (s.block_table.size() > a.max_blocks_per_seq)
      row_error(i, "block table has " + std::to_string(s.block_table.size()) + " blocks > block_tables width " +
                       std::to_string(a.max_blocks_per_seq));
    if (etable) {
      const int32_t lo = std::max(0, p.start - a.engram.max_order() + 1);
      const int32_t vocab = static_cast<int32_t>(etable->size());
      for (int32_t q = lo; q < ctx; ++q) {
        const int32_t t = r.token_at(q);
        if (t < 0 || t >= vocab)
          row_error(i, "token id " + std::to_string(t) + " at position " + std::to_string(q) +
                           " is outside the Engram lookup table (size " + std::to_string(vocab) + ")");
      }
    }
    // Field by field: a whole-struct copy of the local forced a store-forwarding stall per row.
    RowPlan& out = plan[i];
    out.start = p.start;
    out.num = p.num;
    out.src = p.src;
    out.placeholder = false;
    out.seq_id = s.seq_id;
    out.bt = s.block_table.data();
    out.nb = static_cast<int32_t>(s.block_table.size());
    out.version = block_table_version(s);
    if (p.num == 1) {  // (positions and blocks validated above)
      out.token = p.src >= 0 ? 0 : r.token_at(p.start);
      out.slot = static_cast<int64_t>(out.bt[block_of(p.start)]) * bs + offset_in_block(p.start);
    }
    total += p.num;
    max_q = std::max(max_q, p.num);
  }
  const bool pad = decode_only;
  const int32_t num_rows = pad ? a.padded_batch_size(static_cast<int32_t>(n)) : static_cast<int32_t>(n);
  const int32_t q_pad = max_q;
  total += static_cast<int64_t>(num_rows - static_cast<int32_t>(n)) * q_pad;
  if (total > static_cast<int64_t>(a.max_num_tokens))
    throw InvalidArgument("input_ids", "step needs " + std::to_string(total) + " token rows > capacity " +
                          std::to_string(a.max_num_tokens));

  // ---- Write pass. ----
  StepLayout& L = a.layout;
  L.clear();
  L.ensure(static_cast<size_t>(num_rows), static_cast<size_t>(total));  // logits rows <= token rows
  L.zos = zos;
  L.pool_generation = pool.generation();
  const size_t ncols = a.engram.num_columns();
  const int32_t maxn = a.engram.max_order();
  const bool yoco = a.yoco_mode != YocoPrefillTruncationMode::NONE;
  int32_t tok = 0, nlog = 0, nyoco = 0;
  a.query_start_loc.data[0] = 0;
  if (yoco) a.yoco_cu_seqlens.data[0] = 0;
  // Raw output pointers held in registers by the row loop (instead of reloading each member).
  int32_t* const input_ids = a.input_ids.data;
  int32_t* const positions = a.positions.data;
  int64_t* const slot_mapping = a.slot_mapping.data;
  int32_t* const zos_source_index = a.zos_source_index.data;
  int32_t* const logits_indices = a.logits_indices.data;
  int32_t* const seq_lens = a.seq_lens.data;
  int32_t* const query_start_loc = a.query_start_loc.data;
  int32_t* const row_token_offset = L.row_token_offset.data();
  int32_t* const row_logits_offset = L.row_logits_offset.data();
  int32_t* const row_num_tokens = L.row_num_tokens.data();
  int32_t* const row_num_logits = L.row_num_logits.data();
  int64_t* const row_seq_id = L.row_seq_id.data();
  int32_t* const row_zos_src = L.row_zos_src.data();
  int32_t* const logit_row = L.logit_row.data();
  LogitsRowKind* const logit_kind = L.logit_kind.data();
  int32_t* const logit_position = L.logit_position.data();
  int32_t num_prompt_logprob_rows = 0;
  // StepLayout::set_logit on the raw pointers.
  auto set_logit = [=, &num_prompt_logprob_rows](int32_t k, int32_t row, LogitsRowKind kind, int32_t position) {
    logit_row[k] = row;
    logit_kind[k] = kind;
    logit_position[k] = position;
    num_prompt_logprob_rows += kind == LogitsRowKind::PROMPT_LOGPROB;
  };
  for (int32_t i = 0; i < num_rows; ++i) {
    const bool real = i < static_cast<int32_t>(n) && !plan[i].placeholder;
    const int32_t pad_len = i < static_cast<int32_t>(n) ? plan[i].num : q_pad;
    row_token_offset[i] = tok;
    row_logits_offset[i] = nlog;
    if (real) {
      const MetadataRow& r = pool[i];
      const RowPlan& p = plan[i];
      const int32_t* bt = p.bt;
      const int32_t end = p.start + p.num;
      if (p.num == 1 && !etable) {  // a decode row: everything gathered by the validation pass
        input_ids[tok] = p.token;
        positions[tok] = p.start;
        slot_mapping[tok] = p.slot;
        if (zos) zos_source_index[tok] = p.src;
      } else for (int32_t j = 0; j < p.num; ++j) {
        const int32_t pos = p.start + j;
        input_ids[tok + j] = p.src >= 0 ? 0 : r.token_at(pos);
        positions[tok + j] = pos;
        slot_mapping[tok + j] = static_cast<int64_t>(bt[block_of(pos)]) * bs + offset_in_block(pos);
        if (zos) zos_source_index[tok + j] = p.src;
        if (etable) {
          uint64_t window[kEngramMaxOrder];
          for (int32_t w = 0; w < maxn; ++w) {
            const int32_t q = pos - maxn + 1 + w;
            window[w] = q >= 0 ? static_cast<uint64_t>(static_cast<uint32_t>((*etable)[r.token_at(q)])) : kEngramPad;
          }
          engram_hash_window(a.engram, window, a.engram_indices.row(tok + j));
        }
      }
      // Logits rows.
      const int32_t before = nlog;
      if (r.is_prompt && p.src < 0) {
        const Sequence& s = *r.seq;
        const int32_t P = s.num_prompt_tokens;
        if (r.group->params.prompt_logprobs >= 0) {
          // Positions whose logprobs the request already holds (a recompute after preemption
          // computes them again) need no logits row.
          const int32_t first = std::max(p.start, r.group->num_prompt_logprobs);
          for (int32_t pos = first; pos < std::min(end, P - 1); ++pos) {
            logits_indices[nlog++] = tok + (pos - p.start);
            set_logit(nlog - 1, i, LogitsRowKind::PROMPT_LOGPROB, pos);
          }
        }
        if (end == s.num_tokens()) {
          logits_indices[nlog++] = tok + p.num - 1;
          set_logit(nlog - 1, i, LogitsRowKind::SAMPLE, end - 1);
        }
      } else {
        for (int32_t j = 0; j < p.num; ++j) {
          logits_indices[nlog++] = tok + j;
          set_logit(nlog - 1, i, LogitsRowKind::SAMPLE, p.start + j);
        }
      }
      if (yoco) {
        if (a.yoco_mode == YocoPrefillTruncationMode::LAST_TOKEN) {
          a.yoco_kept_rows.data[nyoco++] = tok + p.num - 1;
        } else {
          for (int32_t k = before; k < nlog; ++k) a.yoco_kept_rows.data[nyoco++] = logits_indices[k];
        }
        a.yoco_cu_seqlens.data[i + 1] = nyoco;
      }
      seq_lens[i] = end;
      // Unchanged row (same sequence, version and length): nothing to write, no call.
      if (!(p.version != 0 && a.bt_seq_id[i] == p.seq_id && a.bt_version[i] == p.version && a.bt_len[i] == p.nb))
        write_block_row(a, i, p.seq_id, bt, p.nb, p.version);
      row_num_tokens[i] = p.num;
      row_num_logits[i] = nlog - before;
      row_seq_id[i] = p.seq_id;
      row_zos_src[i] = p.src;
      tok += p.num;
    } else {
      // Placeholder row (padding or aborted): pad_len tokens at position 0 writing nowhere (slot -1), all logits rows.
      for (int32_t j = 0; j < pad_len; ++j) {
        input_ids[tok + j] = 0;
        positions[tok + j] = 0;
        slot_mapping[tok + j] = -1;
        if (zos) zos_source_index[tok + j] = -1;
        if (etable) std::memset(a.engram_indices.row(tok + j), 0, sizeof(int32_t) * ncols);
        logits_indices[nlog++] = tok + j;
        set_logit(nlog - 1, i, LogitsRowKind::PAD, 0);
      }
      if (yoco) {
        if (a.yoco_mode == YocoPrefillTruncationMode::LAST_TOKEN) {
          a.yoco_kept_rows.data[nyoco++] = tok + pad_len - 1;
        } else {
          for (int32_t j = 0; j < pad_len; ++j) a.yoco_kept_rows.data[nyoco++] = tok + j;
        }
        a.yoco_cu_seqlens.data[i + 1] = nyoco;
      }
      seq_lens[i] = pad_len;
      write_block_row(a, i, -1, nullptr, 0, 0);
      row_num_tokens[i] = pad_len;
      row_num_logits[i] = pad_len;
      row_seq_id[i] = -1;
      row_zos_src[i] = -1;
      tok += pad_len;
    }
    query_start_loc[i + 1] = tok;
  }
  L.num_prompt_logprob_rows = num_prompt_logprob_rows;
  L.num_tokens = tok;
  L.num_real_rows = static_cast<int32_t>(n);
  L.num_rows = num_rows;
  L.num_logits = nlog;
  L.num_yoco_rows = nyoco;
  return tok;
}

void zos_discard(PrepareArgs& a, const int64_t* ids, size_t n, std::vector<int32_t>& batch_rows,
                 std::vector<int32_t>& logits_rows) {
  StepLayout& L = a.layout;
  for (int32_t r = 0; r < L.num_real_rows; ++r) {
    const int64_t sid = L.row_seq_id[r];
    if (sid < 0 || std::find(ids, ids + n, sid) == ids + n) continue;
    batch_rows.push_back(r);
    for (int32_t j = 0; j < L.row_num_tokens[r]; ++j) a.slot_mapping.data[L.row_token_offset[r] + j] = -1;
    for (int32_t k = 0; k < L.row_num_logits[r]; ++k) {
      const int32_t lr = L.row_logits_offset[r] + k;
      L.num_prompt_logprob_rows -= L.logit_kind[lr] == LogitsRowKind::PROMPT_LOGPROB;
      L.logit_kind[lr] = LogitsRowKind::PAD;
      logits_rows.push_back(lr);
    }
    L.row_seq_id[r] = -1;
  }
}

}  // namespace deepinfer

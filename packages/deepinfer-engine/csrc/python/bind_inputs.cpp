// Python bindings of the input family: YocoPrefillTruncationMode, SequenceMetadata(Pool),
// PrepareArgs and the input builders prepare_prompt_v4 / prepare_decode_v4 /
// prepare_zos_inputs / prepare_decode_zos_inputs.
#include <pybind11/numpy.h>

#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <optional>

#include "python/bindings.h"
#include "python/buffer_check.h"
#include "python/loose_ints.h"
#include "python/numpy_buffer.h"
#include "python/sampling_params_arg.h"
#include "step/metadata.h"
#include "step/prepare_args.h"
#include "core/scheduler.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

// Snapshot of one metadata row as Python sees it (copies; safe after the store changes).
struct SequenceMetadataInfo {
  int64_t seq_id;
  std::string request_id;
  bool is_prompt, do_sample;
  int32_t num_computed_tokens, num_new_tokens, context_len, num_drafts, num_prompt_tokens, state_slot,
      prompt_logprobs;
  std::vector<int32_t> block_table;
};

SequenceMetadataInfo snapshot(const MetadataRow& r) {
  const Sequence& s = *r.seq;
  return {s.seq_id,  r.group->request_id, r.is_prompt, r.do_sample, r.start, r.num_new, r.context_len(),
          r.num_drafts, s.num_prompt_tokens, s.state_slot, r.group->params.prompt_logprobs, s.block_table};
}


// The numpy arrays a PrepareArgs borrows: kept alive with it, and re-checked before each build
// (an array made read-only since must not be written).
class NumpyBufferOwner final : public BufferOwner {
 public:
  template <class T>
  buf::Buf1D<T> borrow_1d(const py::object& obj, const char* name) {
    py::array a = buf::check_array<T>(obj, name, 1, true);
    arrays_.emplace_back(name, obj);
    return {static_cast<T*>(a.mutable_data()), static_cast<size_t>(a.shape(0))};
  }
  template <class T>
  buf::Buf2D<T> borrow_2d(const py::object& obj, const char* name) {
    py::array a = buf::check_array<T>(obj, name, 2, true);
    arrays_.emplace_back(name, obj);
    return {static_cast<T*>(a.mutable_data()), static_cast<size_t>(a.shape(0)), static_cast<size_t>(a.shape(1))};
  }
  void check_writable() const {
    for (const auto& [name, obj] : arrays_)
      if (!py::reinterpret_borrow<py::array>(obj).writeable())
        buf::fail(name, "became read-only after PrepareArgs was built");
  }

 private:
  std::vector<std::pair<const char*, py::object>> arrays_;
};

int32_t run_builder(PrepareArgs& a, SequenceMetadataPool& pool, BuildMode mode, const PrepareArgs* prev) {
  const char* call = mode == BuildMode::PROMPT ? "prepare_prompt_v4" : mode == BuildMode::DECODE ? "prepare_decode_v4"
                     : mode == BuildMode::ZOS ? "prepare_zos_inputs" : "prepare_decode_zos_inputs";
  BusyGuard args_guard(a.busy, "PrepareArgs", call);
  BusyGuard pool_guard(pool.busy, "SequenceMetadataPool", call);
  std::optional<BusyGuard> sched_guard;  // the builder reads the sequences of the pool's scheduler
  if (pool.source()) sched_guard.emplace(pool.source()->busy, "Scheduler", call);
  static_cast<const NumpyBufferOwner&>(*a.owner).check_writable();
  py::gil_scoped_release nogil;  // everything below is plain C++ on validated memory
  return prepare_inputs(a, pool, mode, prev);
}

}  // namespace

void bind_inputs(py::module_& m) {
  py::enum_<YocoPrefillTruncationMode>(m, "YocoPrefillTruncationMode", R"doc(
Prefill truncation for decoder-decoder (YOCO-style) models whose upper layers write no KV:
which flattened rows continue past the self-decoder. The builders write the kept rows to
``PrepareArgs.yoco_kept_rows`` and their per-sequence offsets to ``yoco_cu_seqlens``.)doc")
      .value("NONE", YocoPrefillTruncationMode::NONE, "Every row runs every layer; no kept-row output.")
      .value("LAST_TOKEN", YocoPrefillTruncationMode::LAST_TOKEN, "Only each sequence's final row of the step.")
      .value("LOGITS_ROWS", YocoPrefillTruncationMode::LOGITS_ROWS,
             "Every row whose logits are needed: sampled rows, prompt-logprob rows, speculative rows.");

  py::class_<SequenceMetadataInfo>(m, "SequenceMetadata", R"doc(
The per-step view of one scheduled sequence, as read from a SequenceMetadataPool
(``pool[i]``): a snapshot (copies), for inspection and tests; the builders read the pool
directly, so the hot path creates no SequenceMetadata objects.)doc")
      .def_readonly("seq_id", &SequenceMetadataInfo::seq_id, "Sequence id.")
      .def_readonly("request_id", &SequenceMetadataInfo::request_id, "Request id.")
      .def_readonly("is_prompt", &SequenceMetadataInfo::is_prompt, "True for a prefill chunk.")
      .def_readonly("do_sample", &SequenceMetadataInfo::do_sample,
                    "True when the step samples a token for it (last prompt chunk or decode).")
      .def_readonly("num_computed_tokens", &SequenceMetadataInfo::num_computed_tokens,
                    "Tokens already in the KV cache before this step (first position computed).")
      .def_readonly("num_new_tokens", &SequenceMetadataInfo::num_new_tokens,
                    "Query length of this step (chunk size, or 1 + drafts).")
      .def_readonly("context_len", &SequenceMetadataInfo::context_len, "num_computed_tokens + num_new_tokens.")
      .def_readonly("num_drafts", &SequenceMetadataInfo::num_drafts, "Draft tokens verified this step.")
      .def_readonly("num_prompt_tokens", &SequenceMetadataInfo::num_prompt_tokens, "Prompt length.")
      .def_readonly("state_slot", &SequenceMetadataInfo::state_slot, "Recurrent-state slot, -1 when none.")
      .def_readonly("prompt_logprobs", &SequenceMetadataInfo::prompt_logprobs,
                    "Prompt logprobs requested (top-k), -1 when none.")
      .def_readonly("block_table", &SequenceMetadataInfo::block_table, "The sequence's KV block ids.")
      .def("__repr__", [](const SequenceMetadataInfo& s) {
        return "SequenceMetadata(seq_id=" + std::to_string(s.seq_id) + ", request_id='" + s.request_id +
               "', is_prompt=" + (s.is_prompt ? "True" : "False") + ", num_computed_tokens=" +
               std::to_string(s.num_computed_tokens) + ", num_new_tokens=" + std::to_string(s.num_new_tokens) + ")";
      });

  py::class_<SequenceMetadataPool>(m, "SequenceMetadataPool", R"doc(
The scheduled sequences of one step, in batch-row order, reused step after step (no
allocation in the steady state). Fill it from a SchedulerOutputs (``build``) or row by row
with ``add_sequence`` (standalone sequences owned by the pool until ``clear``). The builders
(prepare_prompt_v4, ...) and prepare_sampler_inputs read it.)doc")
      .def(py::init<>(), "An empty pool.")
      .def("clear", [](SequenceMetadataPool& p) {
             BusyGuard guard(p.busy, "SequenceMetadataPool", "SequenceMetadataPool.clear");
             p.clear();
           }, "Forget every row (storage is kept for reuse).")
      .def(
          "build",
          [](SequenceMetadataPool& pool, const Scheduler& scheduler) {
            BusyGuard pool_guard(pool.busy, "SequenceMetadataPool", "SequenceMetadataPool.build");
            BusyGuard sched_guard(scheduler.busy, "Scheduler", "SequenceMetadataPool.build");
            if (!scheduler.step_in_flight())
              throw py::value_error("scheduler: no scheduled step (call schedule() before building metadata)");
            pool.build_from(&scheduler.store(), scheduler.last_outputs().scheduled);
            pool.set_source_step(&scheduler, scheduler.step());
            return static_cast<int32_t>(pool.size());
          },
          py::arg("scheduler"),
          "Replace the rows with the sequences of the scheduler's last schedule() (decodes first, then prefill "
          "chunks), without copying their tokens: rows refer to the scheduler's sequences by slot. Returns the "
          "row count. Build after every schedule(): the builders refuse (ValueError naming this call) rows built "
          "for another step of the scheduler, or once it has no step in flight.",
          py::keep_alive<1, 2>())
      .def("__len__", &SequenceMetadataPool::size, "Number of rows.")
      .def(
          "__getitem__",
          [](SequenceMetadataPool& p, py::ssize_t i) {
            const py::ssize_t n = static_cast<py::ssize_t>(p.size());
            if (i < 0) i += n;
            if (i < 0 || i >= n) throw py::index_error("index: " + std::to_string(i) + " out of range for " + std::to_string(n) + " rows");
            BusyGuard guard(p.busy, "SequenceMetadataPool", "SequenceMetadataPool.__getitem__");
            p.resolve();
            return snapshot(p[static_cast<size_t>(i)]);
          },
          py::arg("index"), "Snapshot of row `index` as a SequenceMetadata.")
      .def(
          "add_sequence",
          [](SequenceMetadataPool& pool, int64_t seq_id, const std::string& request_id, const py::handle& token_ids,
             int32_t num_prompt_tokens, int32_t num_computed_tokens, int32_t num_new_tokens,
             const py::handle& block_table, const py::object& draft_tokens, int32_t state_slot,
             std::optional<bool> is_prompt, const py::typing::Optional<SamplingParams>& params, int32_t eos_token_id) {
            BusyGuard guard(pool.busy, "SequenceMetadataPool", "SequenceMetadataPool.add_sequence");
            // Validate everything before the pool changes.
            const SamplingParams& given = sampling_params_arg(params, "params");
            auto tokens = loose_ints(token_ids, "token_ids", 0);
            auto blocks = loose_ints(block_table, "block_table", 0);
            auto drafts = draft_tokens.is_none() ? std::vector<int32_t>{} : loose_ints(draft_tokens, "draft_tokens", 0);
            if (eos_token_id < -1)
              buf::fail("eos_token_id", std::to_string(eos_token_id) + " must be a token id >= 0 or -1 (none)");
            const int32_t L = static_cast<int32_t>(tokens.size());
            if (L < 1) throw py::value_error("token_ids: must not be empty");
            if (num_prompt_tokens < 1 || num_prompt_tokens > L)
              throw py::value_error("num_prompt_tokens: must be in [1, len(token_ids) = " + std::to_string(L) + "], got " + std::to_string(num_prompt_tokens));
            if (num_computed_tokens < 0 || num_computed_tokens >= L + static_cast<int32_t>(drafts.size()))
              throw py::value_error("num_computed_tokens: must be in [0, len(token_ids)), got " + std::to_string(num_computed_tokens));
            if (num_new_tokens < 1) throw py::value_error("num_new_tokens: must be >= 1, got " + std::to_string(num_new_tokens));
            const int32_t end = num_computed_tokens + num_new_tokens;
            const int32_t nd = std::max(0, end - L);
            if (nd > static_cast<int32_t>(drafts.size()))
              throw py::value_error("num_new_tokens: range ends at " + std::to_string(end) + " beyond " + std::to_string(L) +
                                    " tokens + " + std::to_string(drafts.size()) + " draft_tokens");
            const bool prompt = is_prompt.value_or(num_computed_tokens < L - 1);
            if (prompt && nd > 0) throw py::value_error("is_prompt: a prompt chunk cannot include draft tokens");
            if (!prompt && end < L) throw py::value_error("num_new_tokens: a decode row must reach the last token (end " + std::to_string(end) + " < " + std::to_string(L) + ")");
            SamplingParams sp = given;  // validated when it was built (no vocabulary here)
            sp.max_tokens = INT32_MAX;  // the pool never stops a standalone row

            auto [s, g] = pool.add_standalone_row();
            s->seq_id = seq_id;
            s->tokens = std::move(tokens);
            s->num_prompt_tokens = num_prompt_tokens;
            s->num_computed_tokens = num_computed_tokens;
            s->block_table = std::move(blocks);
            touch_block_table(*s);  // a caller-given table: the same seq_id may come with another one
            s->draft_tokens = std::move(drafts);
            s->state_slot = state_slot;
            g->request_id = request_id;
            g->eos_token_id = eos_token_id;
            g->params = std::move(sp);
            MetadataRow& r = pool[pool.size() - 1];
            r.start = num_computed_tokens;
            r.num_new = num_new_tokens;
            r.num_drafts = nd;
            r.is_prompt = prompt;
            r.do_sample = !prompt || end == L;
            r.num_samples = r.do_sample ? 1 : 0;
          },
          py::kw_only(), py::arg("seq_id"), py::arg("request_id"), py::arg("token_ids"), py::arg("num_prompt_tokens"),
          py::arg("num_computed_tokens"), py::arg("num_new_tokens"), py::arg("block_table"),
          py::arg("draft_tokens") = py::none(), py::arg("state_slot") = -1, py::arg("is_prompt") = py::none(),
          py::arg("params") = py::none(), py::arg("eos_token_id") = -1,
          R"doc(Append a standalone row (a sequence the pool owns until clear()): for runtimes without a
Scheduler and for tests. token_ids: prompt + outputs so far (loose: list or int array);
the step computes positions [num_computed_tokens, num_computed_tokens + num_new_tokens),
positions past the known tokens are draft_tokens (a speculative decode row). is_prompt
defaults to num_computed_tokens < len(token_ids) - 1. params: the request's SamplingParams
(None: the defaults; its max_tokens is ignored, the pool never stops a row); eos_token_id:
the request's EOS (-1: none), masked below min_tokens. Raises ValueError/TypeError naming the
argument; the pool is unchanged on error.)doc");

  py::class_<PrepareArgs>(m, "PrepareArgs", R"doc(
Static configuration of input preparation plus the persistent borrowed output buffers the
builders write (numpy arrays, typically ``tensor.numpy()`` views of pinned torch tensors;
never copied). Capacities: ``max_num_tokens = len(input_ids)``, ``max_num_seqs =
block_tables.shape[0]``, ``max_blocks_per_seq = block_tables.shape[1]``. Every buffer is
validated here (dtype, 1-D/2-D, C-contiguous, writable, capacity) — TypeError/ValueError
naming the argument. block_tables is zero-filled once here and then rewritten only where a
row changed. After each builder call the read-only counters (num_tokens, num_seqs,
num_rows, num_logits, num_yoco_rows) describe the step.)doc")
      .def(py::init([](int32_t block_size, int32_t max_model_len, const py::object& input_ids,
                       const py::object& positions, const py::object& slot_mapping, const py::object& query_start_loc,
                       const py::object& seq_lens, const py::object& block_tables, const py::object& logits_indices,
                       const py::object& graph_batch_sizes, YocoPrefillTruncationMode yoco_mode,
                       const py::object& yoco_kept_rows, const py::object& yoco_cu_seqlens,
                       const py::object& engram_ngram_orders, int32_t engram_heads_per_order,
                       const py::object& engram_layer_seeds, const py::object& engram_table_sizes,
                       const py::object& engram_indices, const py::object& zos_source_index) {
             std::vector<int32_t> gbs = graph_batch_sizes.is_none() ? std::vector<int32_t>{}
                                                                    : loose_ints(graph_batch_sizes, "graph_batch_sizes", 1);
             EngramConfig e;
             if (!engram_ngram_orders.is_none()) {
               e.orders = loose_ints(engram_ngram_orders, "engram_ngram_orders", 1);
               e.heads_per_order = engram_heads_per_order;
               if (!engram_layer_seeds.is_none()) {
                 // Seeds are unsigned 64-bit: a list of ints in [0, 2^64).
                 if (!py::isinstance<py::sequence>(engram_layer_seeds) || py::isinstance<py::str>(engram_layer_seeds))
                   throw py::type_error("engram_layer_seeds: expected a sequence of ints");
                 size_t i = 0;
                 for (auto v : engram_layer_seeds) {
                   if (!py::isinstance<py::int_>(v) && !py::hasattr(v, "__index__"))
                     throw py::type_error("engram_layer_seeds[" + std::to_string(i) + "]: expected an int");
                   py::int_ x(py::reinterpret_borrow<py::object>(v));
                   if (x < py::int_(0) || x >= py::int_(1).attr("__lshift__")(64))
                     throw py::value_error("engram_layer_seeds[" + std::to_string(i) + "]: must be in [0, 2**64), got " +
                                           std::string(py::str(x)));
                   e.layer_seeds.push_back(PyLong_AsUnsignedLongLong(x.ptr()));
                   ++i;
                 }
               }
               if (!engram_table_sizes.is_none()) e.table_sizes = loose_int64s(engram_table_sizes, "engram_table_sizes", 1);
             }
             // Element types and layouts here; sizes and the configuration in PrepareArgs. Buffers
             // of a disabled feature are neither checked nor kept.
             auto owner = std::make_unique<NumpyBufferOwner>();
             PrepareBuffers b;
             b.input_ids = owner->borrow_1d<int32_t>(input_ids, "input_ids");
             b.block_tables = owner->borrow_2d<int32_t>(block_tables, "block_tables");
             b.positions = owner->borrow_1d<int32_t>(positions, "positions");
             b.slot_mapping = owner->borrow_1d<int64_t>(slot_mapping, "slot_mapping");
             b.query_start_loc = owner->borrow_1d<int32_t>(query_start_loc, "query_start_loc");
             b.seq_lens = owner->borrow_1d<int32_t>(seq_lens, "seq_lens");
             b.logits_indices = owner->borrow_1d<int32_t>(logits_indices, "logits_indices");
             if (yoco_mode != YocoPrefillTruncationMode::NONE) {
               if (!yoco_kept_rows.is_none()) b.yoco_kept_rows = owner->borrow_1d<int32_t>(yoco_kept_rows, "yoco_kept_rows");
               if (!yoco_cu_seqlens.is_none())
                 b.yoco_cu_seqlens = owner->borrow_1d<int32_t>(yoco_cu_seqlens, "yoco_cu_seqlens");
             }
             if (e.enabled() && !engram_indices.is_none())
               b.engram_indices = owner->borrow_2d<int32_t>(engram_indices, "engram_indices");
             if (!zos_source_index.is_none())
               b.zos_source_index = owner->borrow_1d<int32_t>(zos_source_index, "zos_source_index");
             auto args = std::make_unique<PrepareArgs>(block_size, max_model_len, std::move(gbs), yoco_mode,
                                                       std::move(e), b);
             args->owner = std::move(owner);
             return args;
           }),
           py::kw_only(), py::arg("block_size"), py::arg("max_model_len"), py::arg("input_ids"), py::arg("positions"),
           py::arg("slot_mapping"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("block_tables"),
           py::arg("logits_indices"), py::arg("graph_batch_sizes") = py::none(),
           py::arg_v("yoco_mode", YocoPrefillTruncationMode::NONE, "YocoPrefillTruncationMode.NONE"),
           py::arg("yoco_kept_rows") = py::none(),
           py::arg("yoco_cu_seqlens") = py::none(), py::arg("engram_ngram_orders") = py::none(),
           py::arg("engram_heads_per_order") = 1, py::arg("engram_layer_seeds") = py::none(),
           py::arg("engram_table_sizes") = py::none(), py::arg("engram_indices") = py::none(),
           py::arg("zos_source_index") = py::none(),
           R"doc(Borrowed buffers (all C-contiguous, writable):
input_ids int32 (T,); positions int32 (>= T,); slot_mapping int64 (>= T,);
query_start_loc int32 (>= S + 1,); seq_lens int32 (>= S,); block_tables int32 (S, W);
logits_indices int32 (>= T,); yoco_kept_rows int32 (>= T,) and yoco_cu_seqlens int32
(>= S + 1,) when yoco_mode is not NONE; engram_indices int32 (>= T, C) with
C = len(engram_layer_seeds) * len(engram_ngram_orders) * engram_heads_per_order when Engram
is on; zos_source_index int32 (>= T,) for the ZOS builders. graph_batch_sizes: decode batch
sizes to pad to (each <= S; loose list). Engram: n-gram orders (each 1..16), heads per
order, one hash seed per Engram layer, one table size per order (1..2^31-1).)doc")
      .def_readonly("block_size", &PrepareArgs::block_size, "Tokens per KV block.")
      .def_readonly("max_model_len", &PrepareArgs::max_model_len, "Longest context a row may reach.")
      .def_readonly("graph_batch_sizes", &PrepareArgs::graph_batch_sizes, "Sorted decode graph batch sizes.")
      .def_readonly("yoco_mode", &PrepareArgs::yoco_mode, "YOCO prefill truncation mode.")
      .def_readonly("max_num_tokens", &PrepareArgs::max_num_tokens, "Token-row capacity (len(input_ids)).")
      .def_readonly("max_num_seqs", &PrepareArgs::max_num_seqs, "Batch-row capacity (block_tables rows).")
      .def_readonly("max_blocks_per_seq", &PrepareArgs::max_blocks_per_seq, "Block-table width.")
      .def_property_readonly("engram_num_columns", [](const PrepareArgs& a) { return a.engram.num_columns(); },
                             "Columns of engram_indices (0 when Engram is off).")
      .def_property_readonly("num_tokens", [](const PrepareArgs& a) { return a.layout.num_tokens; },
                             "Flattened token rows of the last step (padding included).")
      .def_property_readonly("num_seqs", [](const PrepareArgs& a) { return a.layout.num_real_rows; },
                             "Real (non-placeholder) batch rows of the last step.")
      .def_property_readonly("num_rows", [](const PrepareArgs& a) { return a.layout.num_rows; },
                             "Batch rows of the last step, padding rows included.")
      .def_property_readonly("num_logits", [](const PrepareArgs& a) { return a.layout.num_logits; },
                             "Logits rows of the last step (entries of logits_indices).")
      .def_property_readonly("num_yoco_rows", [](const PrepareArgs& a) { return a.layout.num_yoco_rows; },
                             "Kept rows of the last step (YOCO modes other than NONE).")
      .def_property_readonly("num_block_rows_written", [](const PrepareArgs& a) { return a.num_block_rows_written; },
                             "Block-table rows (re)written since construction (incremental-update statistics).")
      .def_property_readonly("row_seq_ids", [](py::object self) {
            const auto& a = self.cast<const PrepareArgs&>();
            return read_only(py::array_t<int64_t>({static_cast<py::ssize_t>(a.layout.num_rows)}, {sizeof(int64_t)},
                                                  a.layout.row_seq_id.data(), self));
          }, "Per batch row of the last step: its seq_id, -1 for placeholder or discarded rows (a read-only view, "
             "valid until the next prepare or zos_discard with these args).")
      .def(
          "zos_discard",
          [](PrepareArgs& a, const py::handle& finished_seq_ids) {
            auto ids = loose_int64s(finished_seq_ids, "finished_seq_ids", 0);
            BusyGuard guard(a.busy, "PrepareArgs", "PrepareArgs.zos_discard");
            std::vector<int32_t> rows, logits;
            zos_discard(a, ids.data(), ids.size(), rows, logits);
            return py::make_tuple(py::array_t<int32_t>(rows.size(), rows.data()),
                                  py::array_t<int32_t>(logits.size(), logits.data()));
          },
          py::arg("finished_seq_ids"),
          R"doc(ZOS: after step N's update, turn the rows of the last prepared step that belong to
sequences finished at step N into placeholders: their slot_mapping entries become -1 (no KV
write into freed blocks) and their logits rows stop sampling. Returns (batch_rows,
logits_rows) int32 arrays of the discarded rows; the runtime ignores outputs of those rows.)doc");

  const char* builder_doc_tail = R"doc(

args: the PrepareArgs whose buffers are written; metadata: the step's SequenceMetadataPool.
Writes input_ids, positions, slot_mapping (block_table[p // block_size] * block_size +
p % block_size), query_start_loc, seq_lens, block-table rows that changed, logits_indices,
and the YOCO / Engram outputs when enabled. Returns the number of token rows. Releases the
GIL. Validates every row first (ValueError naming metadata[i] and the problem, or the buffer
whose capacity is exceeded): nothing is written when a call is rejected.)doc";
  m.def("prepare_prompt_v4", [](PrepareArgs& args, SequenceMetadataPool& metadata) {
        return run_builder(args, metadata, BuildMode::PROMPT, nullptr);
      }, py::arg("args"), py::arg("metadata"),
        (std::string("Build the model inputs of a step with prefill chunks (decode rows may be mixed in), "
                     "in metadata order, without padding.") + builder_doc_tail).c_str());
  m.def("prepare_decode_v4", [](PrepareArgs& args, SequenceMetadataPool& metadata) {
        return run_builder(args, metadata, BuildMode::DECODE, nullptr);
      }, py::arg("args"), py::arg("metadata"),
        (std::string("Build the model inputs of a decode-only step (each row: its last token, plus drafts for "
                     "speculative rows), padded to the next graph batch size with placeholder rows (max query "
                     "length tokens each, input 0, position 0, slot -1, seq_len = that length, zero block-table "
                     "row, all their tokens logits rows).") + builder_doc_tail).c_str());
  m.def("prepare_zos_inputs", [](PrepareArgs& args, SequenceMetadataPool& metadata, const PrepareArgs& prev) {
        return run_builder(args, metadata, BuildMode::ZOS, &prev);
      }, py::arg("args"), py::arg("metadata"), py::arg("prev"),
        (std::string("ZOS (zero-overhead scheduling): build step N+1 while step N runs, before its sampled tokens "
                     "reach the host. prev: the PrepareArgs of step N (may be args itself). A decode row of a "
                     "sequence that sampled in step N becomes one token at position len(tokens) (the pending "
                     "token): input_ids 0 and zos_source_index = the logits row of step N whose sampled token it "
                     "is; every other token row has zos_source_index -1 (input_ids is the token). The device "
                     "resolves ids = where(src >= 0, sampled[src], input_ids). Mixed prefill rows are built as in "
                     "prepare_prompt_v4. Engram is refused (it hashes token values).") + builder_doc_tail).c_str());
  m.def("prepare_decode_zos_inputs", [](PrepareArgs& args, SequenceMetadataPool& metadata, const PrepareArgs& prev) {
        return run_builder(args, metadata, BuildMode::DECODE_ZOS, &prev);
      }, py::arg("args"), py::arg("metadata"), py::arg("prev"),
        (std::string("The decode-only ZOS builder: as prepare_zos_inputs, padded like prepare_decode_v4.") +
         builder_doc_tail).c_str());
}

}  // namespace deepinfer

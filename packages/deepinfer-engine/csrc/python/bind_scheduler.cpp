// Python bindings of the scheduler family: BlockManager, SchedulerOutputs, Scheduler,
// clone_and_zero_states_and_blocks.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <variant>

#include "python/bindings.h"
#include "python/buffer_check.h"
#include "python/loose_ints.h"
#include "python/numpy_arrays.h"
#include "python/sampling_params_arg.h"
#include "core/request_output.h"
#include "python/sequence_handle.h"

namespace deepinfer {

namespace {

OutputKind parse_output_kind(const std::string& s) {
  if (s == "cumulative") return OutputKind::CUMULATIVE;
  if (s == "delta") return OutputKind::DELTA;
  if (s == "final_only") return OutputKind::FINAL_ONLY;
  buf::fail("output_kind", "'" + s + "' is not one of 'cumulative', 'delta', 'final_only'");
}

py::typing::Dict<py::str, py::object> scheduler_stats(const Scheduler& s) {
  const SchedulerStats st = s.stats();
  const BlockManagerStats b = const_cast<Scheduler&>(s).block_manager().stats();
  py::typing::Dict<py::str, py::object> d;
  d["num_running"] = st.num_running;
  d["num_waiting"] = st.num_waiting;
  d["num_preempted"] = st.num_preempted;
  d["num_preemptions_total"] = st.num_preemptions_total;
  d["num_unfinished_requests"] = s.num_unfinished();
  d["kv_usage"] = st.kv_usage;
  d["prefix_cache_hit_rate"] = st.prefix_hit_rate;
  d["prefix_cache_queries"] = b.prefix_queries;
  d["prefix_cache_hits"] = b.prefix_hits;
  d["num_free_blocks"] = b.num_free_blocks;
  d["num_cached_blocks"] = b.num_cached_blocks;
  d["num_evictions"] = b.num_evictions;
  d["num_cow_copies"] = b.num_cow_copies;
  return d;
}

// Scheduler.add_request after its arguments were read: the prompt (a C-contiguous int32 array is
// read in place, anything else converted) and a copy of the request's SamplingParams with its
// request attributes; Scheduler::check_request validates the whole request.
int64_t add_request_typed(Scheduler& s, const std::string& request_id, const py::object& prompt_token_ids,
                          const SamplingParams& params, int32_t priority, OutputKind output_kind,
                          std::optional<double> arrival_time, std::optional<int64_t> eos_token_id,
                          uint64_t cache_salt) {
  std::vector<int32_t> converted;
  const int32_t* prompt = nullptr;
  size_t prompt_len = 0;
  if (py::isinstance<py::array>(prompt_token_ids)) {
    auto a = py::reinterpret_borrow<py::array>(prompt_token_ids);
    if (a.dtype().is(py::dtype::of<int32_t>()) && a.ndim() == 1 && (a.flags() & py::array::c_style)) {
      prompt = static_cast<const int32_t*>(a.data());
      prompt_len = static_cast<size_t>(a.shape(0));
    }
  }
  if (!prompt) {
    converted = loose_ints(prompt_token_ids, "prompt_token_ids", 0);
    prompt = converted.data();
    prompt_len = converted.size();
  }
  int32_t eos = s.config().eos_token_id;
  if (eos_token_id) {  // None is the scheduler's default: a given value must be a token
    const int64_t e = *eos_token_id;
    if (e < 0 || e > INT32_MAX)
      buf::fail("eos_token_id", std::to_string(e) + " is outside the vocabulary [0, " +
                                    std::to_string(s.config().vocab_size) + ")");
    eos = static_cast<int32_t>(e);
  }
  const double arrival = arrival_time ? *arrival_time : s.now();
  // The group stores its own copy: priority and output_kind are set on it, not on the caller's.
  const GroupIndex g = [&] {
    if (priority == params.priority && output_kind == params.output_kind)
      return s.add_request(request_id, prompt, prompt_len, params, arrival, eos, cache_salt);
    SamplingParams p = params;
    p.priority = priority;
    p.output_kind = output_kind;
    return s.add_request(request_id, prompt, prompt_len, p, arrival, eos, cache_salt);
  }();
  return s.store().seq(s.store().groups[g].seqs[0]).seq_id;
}

// sampled_token_ids of Scheduler.update as int32 vocabulary ids. A C-contiguous int32 numpy
// array is read in place (its ids are checked by the caller); any other 1-D integer array — a
// numpy array of another integer dtype or layout, a CPU tensor through DLPack, a list — is
// converted once into `scratch`, each value checked against the vocabulary first (so a wide
// value is never truncated into a valid id). `holder` keeps a converted source alive.
const int32_t* sampled_token_rows(const py::object& obj, int32_t rows, int32_t vocab, py::object& holder,
                                  std::vector<int32_t>& scratch) {
  const char* name = "sampled_token_ids";
  auto out_of_vocab = [&](long long id, int32_t r) {
    buf::fail(name, "token id " + std::to_string(id) + " at row " + std::to_string(r) +
                        " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  };
  if (py::isinstance<py::array>(obj)) {
    holder = obj;
  } else if (py::hasattr(obj, "__dlpack__")) {
    try {
      holder = py::module_::import("numpy").attr("from_dlpack")(obj);
    } catch (py::error_already_set& e) {
      throw py::type_error(std::string(name) + ": cannot read " +
                           std::string(py::str(py::type::of(obj).attr("__name__"))) +
                           " through DLPack on the CPU (" + e.what() + "); pass a CPU array");
    }
  } else {
    const std::vector<int64_t> v = loose_int64s(obj, name, INT64_MIN);
    if (static_cast<int64_t>(v.size()) != rows)
      buf::fail(name, "expected " + std::to_string(rows) + " elements, got " + std::to_string(v.size()));
    scratch.resize(v.size());
    for (int32_t r = 0; r < rows; ++r) {
      if (v[r] < 0 || v[r] >= vocab) out_of_vocab(v[r], r);
      scratch[r] = static_cast<int32_t>(v[r]);
    }
    return scratch.data();
  }
  const auto a = py::reinterpret_borrow<py::array>(holder);
  // The usual case first, without dtype.kind (a Python attribute read).
  const bool is_int32 = a.dtype().is(py::dtype::of<int32_t>());
  const char kind = is_int32 ? 'i' : a.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(name) + ": expected integer token ids, got dtype " + std::string(py::str(a.dtype())));
  if (a.ndim() != 1 || a.shape(0) != rows)
    buf::fail(name, "expected " + std::to_string(rows) + " elements, got shape " + buf::shape_str(a));
  if (is_int32 && (a.flags() & py::array::c_style)) return static_cast<const int32_t*>(a.data());
  scratch.resize(static_cast<size_t>(rows));
  const char* base = static_cast<const char*>(a.data());
  const py::ssize_t stride = rows > 0 ? a.strides(0) : 0;
  const py::ssize_t size = a.itemsize();
  for (int32_t r = 0; r < rows; ++r) {
    const char* p = base + r * stride;
    long long id;
    if (kind == 'i') {
      if (size == 1) id = *reinterpret_cast<const int8_t*>(p);
      else if (size == 2) id = *reinterpret_cast<const int16_t*>(p);
      else if (size == 4) id = *reinterpret_cast<const int32_t*>(p);
      else id = *reinterpret_cast<const int64_t*>(p);
      if (id < 0 || id >= vocab) out_of_vocab(id, r);
    } else {
      unsigned long long u;
      if (size == 1) u = *reinterpret_cast<const uint8_t*>(p);
      else if (size == 2) u = *reinterpret_cast<const uint16_t*>(p);
      else if (size == 4) u = *reinterpret_cast<const uint32_t*>(p);
      else u = *reinterpret_cast<const uint64_t*>(p);
      if (u >= static_cast<unsigned long long>(vocab)) {
        if (u > static_cast<unsigned long long>(INT64_MAX))
          buf::fail(name, "token id " + std::to_string(u) + " at row " + std::to_string(r) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
        out_of_vocab(static_cast<long long>(u), r);
      }
      id = static_cast<long long>(u);
    }
    scratch[r] = static_cast<int32_t>(id);
  }
  return scratch.data();
}


// The keyword arguments of Scheduler.add_request (only the given ones are looked at).
int64_t add_request_kwargs(Scheduler& s, const std::string& request_id, const py::object& prompt_token_ids,
                           const py::handle& params, const py::kwargs& kw) {
  const SamplingParams& p = sampling_params_arg(params, "params");
  int32_t priority = 0;
  OutputKind output_kind = OutputKind::CUMULATIVE;
  std::optional<int64_t> eos;
  std::optional<double> arrival;
  uint64_t cache_salt = 0;
  auto type_name = [](const py::handle& v) { return std::string(py::str(py::type::of(v).attr("__name__"))); };
  auto as_int = [&](const py::handle& v, const char* name) -> int64_t {
    if (py::isinstance<py::bool_>(v) || !(py::isinstance<py::int_>(v) || py::hasattr(v, "__index__")))
      throw py::type_error(std::string(name) + ": expected int, got " + type_name(v));
    return python_int64(v, name);
  };
  for (auto item : kw) {
    const std::string key = py::cast<std::string>(item.first);
    const py::handle v = item.second;
    const char* k = key.c_str();
    if (key == "priority") {
      const int64_t x = as_int(v, k);
      if (x < INT32_MIN || x > INT32_MAX) buf::fail(k, std::to_string(x) + " is out of the int32 range");
      priority = static_cast<int32_t>(x);
    } else if (key == "output_kind") {
      if (!py::isinstance<py::str>(v)) throw py::type_error("output_kind: expected str, got " + type_name(v));
      output_kind = parse_output_kind(py::cast<std::string>(v));
    } else if (key == "arrival_time") {
      if (!v.is_none()) {
        if (py::isinstance<py::bool_>(v) || !(py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v) ||
                                              py::hasattr(v, "__float__")))
          throw py::type_error("arrival_time: expected float, got " + type_name(v));
        arrival = py::cast<double>(v);
      }
    } else if (key == "eos_token_id") {
      if (!v.is_none()) eos = as_int(v, k);
    } else if (key == "cache_salt") {
      if (!v.is_none()) {
        if (!py::isinstance<py::str>(v)) throw py::type_error("cache_salt: expected str, got " + type_name(v));
        Py_ssize_t size = 0;
        const char* utf8 = PyUnicode_AsUTF8AndSize(v.ptr(), &size);
        if (!utf8) {
          PyErr_Clear();
          buf::fail(k, "is not valid Unicode text (a lone surrogate)");
        }
        if (size == 0) buf::fail(k, "must be a non-empty string (or None: no salt)");
        cache_salt = BlockManager::salt_seed(std::string(utf8, static_cast<size_t>(size)));
      }
    } else if (is_sampling_field(key)) {
      throw py::type_error("add_request() got an unexpected keyword argument '" + key +
                           "': sampling parameters go in a SamplingParams (params=SamplingParams(" + key + "=...))");
    } else {
      throw py::type_error("add_request() got an unexpected keyword argument '" + key + "'");
    }
  }
  return add_request_typed(s, request_id, prompt_token_ids, p, priority, output_kind, arrival, eos, cache_salt);
}

}  // namespace

void bind_scheduler_outputs(py::module_& m) {
  // ---------------------------------------------------------------- BlockManager
  py::class_<BlockManager>(m, "BlockManager",
                           "The paged KV cache of a Scheduler (``Scheduler.block_manager``): ref-counted "
                           "blocks, prefix caching verified against stored tokens, LRU eviction of cached free "
                           "blocks, copy-on-write, watermark. Not constructible from Python.")
      .def_property_readonly("num_blocks", &BlockManager::num_blocks, "Total KV blocks.")
      .def_property_readonly("block_size", &BlockManager::block_size, "Tokens per block.")
      .def_property_readonly("num_free_blocks", &BlockManager::num_free_blocks,
                             "Free blocks (uncached + cached evictable).")
      .def_property_readonly("watermark_blocks", &BlockManager::watermark_blocks,
                             "Blocks kept free when admitting sequences.")
      .def_property_readonly("enable_prefix_caching", &BlockManager::prefix_caching, "Prefix caching on.")
      .def_property_readonly(
          "usage", [](const BlockManager& b) { return 1.0 - double(b.num_free_blocks()) / b.num_blocks(); },
          "Fraction of blocks in use.")
      .def_property_readonly(
          "num_cached_blocks", [](const BlockManager& b) { return b.stats().num_cached_blocks; },
          "Blocks registered in the prefix cache (free or in use).")
      .def_property_readonly(
          "prefix_cache_hit_rate",
          [](const BlockManager& b) {
            auto s = b.stats();
            return s.prefix_queries ? double(s.prefix_hits) / s.prefix_queries : 0.0;
          },
          "Prompt tokens served from the prefix cache / prompt tokens looked up, at admissions.")
      .def_property_readonly(
          "num_evictions", [](const BlockManager& b) { return b.stats().num_evictions; },
          "Cached blocks evicted to serve allocations.")
      .def_property_readonly(
          "num_cow_copies", [](const BlockManager& b) { return b.stats().num_cow_copies; },
          "Partial blocks copied (forks and copy-on-write).")
      .def(
          "ref_count",
          [](const BlockManager& b, int32_t block) {
            if (block < 0 || block >= b.num_blocks())
              buf::fail("block", std::to_string(block) + " is outside [0, " + std::to_string(b.num_blocks()) + ")");
            return b.ref_count(block);
          },
          py::arg("block"), "Reference count of a block (number of block tables holding it).")
      .def(
          "is_cached",
          [](const BlockManager& b, int32_t block) {
            if (block < 0 || block >= b.num_blocks())
              buf::fail("block", std::to_string(block) + " is outside [0, " + std::to_string(b.num_blocks()) + ")");
            return b.is_cached(block);
          },
          py::arg("block"), "Whether a block is registered in the prefix cache.");

  // ---------------------------------------------------------------- SchedulerOutputs
  py::class_<SchedulerOutputs>(
      m, "SchedulerOutputs",
      "What one step runs, returned by Scheduler.schedule(). Owned by the scheduler and rewritten by "
      "the next schedule(): read it before that. Arrays are fresh copies. Scheduled entries: decodes "
      "first (``num_decodes`` of them), then prefill chunks.")
      .def_readonly("step", &SchedulerOutputs::step, "Step number (1 for the first schedule()).")
      .def_readonly("num_decodes", &SchedulerOutputs::num_decodes, "Entries [0, num_decodes) are decodes.")
      .def_readonly("num_batched_tokens", &SchedulerOutputs::num_batched_tokens, "Tokens computed this step.")
      .def_readonly("num_prefill_tokens", &SchedulerOutputs::num_prefill_tokens, "Prefill tokens this step.")
      .def_readonly("num_decode_tokens", &SchedulerOutputs::num_decode_tokens, "Decode tokens (incl. drafts).")
      .def_readonly("num_sample_rows", &SchedulerOutputs::num_sample_rows,
                    "Tokens Scheduler.update expects (sum of num_samples).")
      .def("__len__", [](const SchedulerOutputs& o) { return o.scheduled.size(); }, "Scheduled sequences.")
      .def_property_readonly(
          "is_empty", [](const SchedulerOutputs& o) { return o.scheduled.empty(); }, "Nothing scheduled.")
      .def_property_readonly(
          "seq_ids",
          [](const SchedulerOutputs& o) {
            py::array_t<int64_t> a(static_cast<py::ssize_t>(o.scheduled.size()));
            for (size_t i = 0; i < o.scheduled.size(); ++i) a.mutable_data()[i] = o.store->seq(o.scheduled[i].seq).seq_id;
            return a;
          },
          "int64[len]: the scheduled sequences' ids.")
      .def_property_readonly(
          "request_ids",
          [](const SchedulerOutputs& o) {
            py::list l;
            for (const auto& e : o.scheduled) l.append(o.store->group_of(e.seq).request_id);
            return l;
          },
          "list[str]: the scheduled sequences' request ids.")
      .def_property_readonly(
          "num_scheduled_tokens",
          [](const SchedulerOutputs& o) {
            py::array_t<int32_t> a(static_cast<py::ssize_t>(o.scheduled.size()));
            for (size_t i = 0; i < o.scheduled.size(); ++i) a.mutable_data()[i] = o.scheduled[i].num_tokens;
            return a;
          },
          "int32[len]: tokens computed per scheduled sequence.")
      .def_property_readonly(
          "num_computed_tokens",
          [](const SchedulerOutputs& o) {
            py::array_t<int32_t> a(static_cast<py::ssize_t>(o.scheduled.size()));
            for (size_t i = 0; i < o.scheduled.size(); ++i) a.mutable_data()[i] = o.scheduled[i].num_computed_before;
            return a;
          },
          "int32[len]: computed tokens of each sequence before this step (its first position).")
      .def_property_readonly(
          "num_samples",
          [](const SchedulerOutputs& o) {
            py::array_t<int32_t> a(static_cast<py::ssize_t>(o.scheduled.size()));
            for (size_t i = 0; i < o.scheduled.size(); ++i) a.mutable_data()[i] = o.scheduled[i].num_samples;
            return a;
          },
          "int32[len]: sample rows per sequence (0 mid-prefill; n when an n > 1 prompt completes).")
      .def_property_readonly(
          "is_prefill",
          [](const SchedulerOutputs& o) {
            py::array_t<bool> a(static_cast<py::ssize_t>(o.scheduled.size()));
            for (size_t i = 0; i < o.scheduled.size(); ++i) a.mutable_data()[i] = o.scheduled[i].is_prefill;
            return a;
          },
          "bool[len]: prompt (or recompute) chunk rather than a decode.")
      .def_property_readonly("preempted_seq_ids", [](const SchedulerOutputs& o) { return to_array(o.preempted_seq_ids); },
                             "int64: sequences preempted (recompute) by this step.")
      .def_property_readonly("ignored_seq_ids", [](const SchedulerOutputs& o) { return to_array(o.ignored_seq_ids); },
                             "int64: sequences finished as ignored (prompt too long) by this step.")
      .def_property_readonly("blocks_to_copy", [](const SchedulerOutputs& o) { return pairs_array(o.blocks_to_copy); },
                             "int32[k, 2]: (src, dst) KV blocks to copy before the forward.")
      .def_property_readonly("states_to_clone", [](const SchedulerOutputs& o) { return pairs_array(o.states_to_clone); },
                             "int32[k, 2]: (src, dst) state slots to clone before the forward.")
      .def_property_readonly("states_to_zero", [](const SchedulerOutputs& o) { return to_array(o.states_to_zero); },
                             "int32[k]: state slots to zero before the forward.");

}

void bind_scheduler(py::module_& m) {
  // ---------------------------------------------------------------- Scheduler
  py::class_<Scheduler> sched_cls(
      m, "Scheduler",
      "Continuous-batching scheduler owning every sequence (C++), its KV block manager and its "
      "state slots. Step: schedule() -> inputs/model -> update(tokens) -> build_request_outputs / "
      "get_finished_seqs_info.");
  sched_cls.def(py::init([](int32_t num_blocks, int32_t block_size, int32_t max_num_seqs, int32_t max_num_batched_tokens,
                       int32_t max_model_len, int32_t vocab_size, std::optional<int64_t> eos_token_id,
                       bool enable_chunked_prefill, int32_t long_prefill_token_threshold, const std::string& policy,
                       bool enable_prefix_caching, double watermark, int32_t num_lookahead_slots,
                       int32_t num_state_slots, int32_t hash_bits) {
             SchedulerConfig c;
             c.num_blocks = num_blocks;
             c.block_size = block_size;
             c.max_num_seqs = max_num_seqs;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.max_model_len = max_model_len;
             c.vocab_size = vocab_size;
             if (eos_token_id) {  // None is -1 (no EOS): a given value must be a token
               const int64_t e = *eos_token_id;
               if (e < 0 || e > INT32_MAX)
                 buf::fail("eos_token_id", std::to_string(e) + " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
               c.eos_token_id = static_cast<int32_t>(e);
             }
             c.enable_chunked_prefill = enable_chunked_prefill;
             c.long_prefill_token_threshold = long_prefill_token_threshold;
             if (policy == "fcfs") c.policy = SchedulingPolicy::FCFS;
             else if (policy == "priority") c.policy = SchedulingPolicy::PRIORITY;
             else buf::fail("policy", "'" + policy + "' is not 'fcfs' or 'priority'");
             c.enable_prefix_caching = enable_prefix_caching;
             c.watermark = watermark;
             c.num_lookahead_slots = num_lookahead_slots;
             c.num_state_slots = num_state_slots;
             c.hash_bits = hash_bits;
             // The constructor validates the configuration (SchedulerConfig::validated).
             return new Scheduler(c);
           }),
           // Keyword-only after num_blocks: vocab_size has no default, and a Python signature
           // cannot put a required positional argument after defaulted ones.
           py::arg("num_blocks"), py::kw_only(), py::arg("block_size") = 16, py::arg("max_num_seqs") = 256,
           py::arg("max_num_batched_tokens") = 8192, py::arg("max_model_len") = 8192, py::arg("vocab_size"),
           py::arg("eos_token_id") = py::none(), py::arg("enable_chunked_prefill") = true,
           py::arg("long_prefill_token_threshold") = 0, py::arg("policy") = "fcfs",
           py::arg("enable_prefix_caching") = true, py::arg("watermark") = 0.01, py::arg("num_lookahead_slots") = 0,
           py::arg("num_state_slots") = 0, py::arg("hash_bits") = 64,
           "Create a scheduler. policy: 'fcfs' or 'priority' (smaller priority value first). "
           "long_prefill_token_threshold: per-sequence prefill tokens per step (0: no cap). watermark: fraction "
           "of blocks kept free when admitting. num_state_slots: recurrent-state slots (0: none; else >= "
           "max_num_seqs). hash_bits < 64 truncates prefix hashes (test hook: forces collisions). Raises "
           "ValueError naming a bad value, e.g. when the cache cannot hold one max_model_len sequence, or when "
           "the host bookkeeping of num_blocks (BlockManager tables) would need more than half of the physical "
           "memory or the address-space limit.")
      ;
  {
    // add_request parses only the keyword arguments given (pybind11's generic keyword matching
    // costs ~2 us per call); its signature line is written by hand for the stubs.
    py::options sig;
    sig.disable_function_signatures();
    sched_cls
      .def(
          "add_request",
          [](Scheduler& s, const std::string& request_id, const py::object& prompt_token_ids,
             const py::object& params, const py::kwargs& kw) {
            BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.add_request");
            return add_request_kwargs(s, request_id, prompt_token_ids, params, kw);
          },
          py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("params") = py::none(),
          "add_request(self, request_id: str, prompt_token_ids: typing.Any, params: SamplingParams | None = None, "
          "*, arrival_time: float | None = None, output_kind: str = 'cumulative', priority: int = 0, "
          "eos_token_id: int | None = None, cache_salt: str | None = None) -> int\n\n"
          "Queue a request; returns the parent sequence's id. prompt_token_ids: list or integer array "
          "(loose). params: the request's SamplingParams (validated when it was built; None: the "
          "defaults); the scheduler keeps a copy and bounds its token ids and logprob counts by the "
          "vocabulary. arrival_time: time.time() value (None: now); output_kind 'cumulative' | 'delta' | "
          "'final_only'; priority: smaller is scheduled first under the 'priority' policy (vLLM); "
          "eos_token_id: this request's EOS (None: the scheduler's); cache_salt: a secret string "
          "(vLLM's): the request reuses prefix-cached KV only of requests with the same salt, so "
          "tenants cannot probe each other's prompts by timing (None: the shared, unsalted cache). "
          "Raises ValueError naming the bad value (duplicate request id, token outside the vocabulary...), "
          "TypeError for a sampling keyword (they belong in SamplingParams); nothing is queued then.")
      ;
  }
  sched_cls
      .def(
          "abort_request",
          [](Scheduler& s, const std::variant<std::string, std::vector<std::string>>& request_ids) {
            BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.abort_request");
            std::vector<std::string> ids;
            if (std::holds_alternative<std::string>(request_ids)) ids.push_back(std::get<std::string>(request_ids));
            else ids = std::get<std::vector<std::string>>(request_ids);
            for (const auto& id : ids)
              if (!s.has_request(id)) buf::fail("request_id", "unknown request id '" + id + "'");
            int32_t n = 0;
            for (const auto& id : ids) n += s.abort_request(id);
            return n;
          },
          py::arg("request_ids"),
          "Abort one request id (str) or several (iterable of str), at any point (waiting, mid-prefill, "
          "running, preempted, or while a step runs: its rows are then ignored by update). Returns how many "
          "were still unfinished. Raises ValueError for an unknown id (nothing is aborted then).")
      .def(
          "schedule",
          [](py::object self, bool overlap) -> py::typing::Optional<SchedulerOutputs> {
            Scheduler& s = self.cast<Scheduler&>();
            BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.schedule");
            const SchedulerOutputs* out = nullptr;
            if (overlap) {
              if (!s.step_in_flight())
                throw py::value_error("schedule(overlap=True): no step in flight to run ahead of "
                                      "(call schedule() first)");
              if (s.step_ahead())
                throw py::value_error("schedule(overlap=True): step " + std::to_string(s.step()) +
                                      " already runs ahead of step " + std::to_string(s.step() - 1) +
                                      " (call update() for step " + std::to_string(s.step() - 1) + " first)");
              py::gil_scoped_release nogil;
              out = s.schedule_ahead();
            } else {
              if (s.step_in_flight())
                throw py::value_error("schedule: step " + std::to_string(s.update_target().step) +
                                      " is still waiting for update()");
              py::gil_scoped_release nogil;
              out = &s.schedule();
            }
            if (out == nullptr) return py::reinterpret_borrow<py::typing::Optional<SchedulerOutputs>>(py::none());
            return py::reinterpret_steal<py::typing::Optional<SchedulerOutputs>>(
                py::cast(out, py::return_value_policy::reference_internal, self).release());
          },
          py::arg("overlap") = false,
          "Schedule the next step (releases the GIL). Returns the scheduler's SchedulerOutputs (rewritten by "
          "the next call). Raises ValueError if the previous step has not been updated.\n\n"
          "overlap=True (ZOS): schedule step N+1 while step N is in flight, before its tokens are known, "
          "assuming one new token per sequence of step N (the ZOS builders then take each row's input token "
          "from step N's sampled tokens on the device). Returns None, changing nothing, when step N+1 cannot "
          "run ahead: step N is not plain decodes (prefill chunks, drafts, n > 1 samples, block copies), a "
          "request waits or a preempted one would resume, a sequence needs a copy-on-write or blocks that are "
          "not free (preemption), or every sequence surely finishes at step N; then update step N and schedule "
          "synchronously. Sequences that surely finish at step N (max_tokens, max_model_len) are left out of "
          "step N+1. While a step runs ahead (step_ahead), update() applies step N, and a sequence that "
          "finishes there (EOS, stop token, stop_sequence, abort) keeps its step N+1 row, whose token update() "
          "then ignores. ValueError when no step is in flight or a step already runs ahead.")
      .def(
          "update",
          [](Scheduler& s, const py::object& sampled_token_ids, const py::object& logprobs,
             const py::object& topk_token_ids, const py::object& topk_logprobs) {
            BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.update");
            if (!s.step_in_flight()) throw py::value_error("update: no scheduled step (call schedule() first)");
            const SchedulerOutputs& o = s.update_target();  // the older step when one runs ahead
            if (s.step_ahead() && py::hasattr(sampled_token_ids, "__len__") &&
                py::len(sampled_token_ids) != static_cast<size_t>(o.num_sample_rows))
              buf::fail("sampled_token_ids",
                        "update applies step " + std::to_string(o.step) + " (step " + std::to_string(s.step()) +
                            " runs ahead of it), which has " + std::to_string(o.num_sample_rows) +
                            " sample rows; got " + std::to_string(py::len(sampled_token_ids)) + " tokens");
            // A decode with drafts computes 1 + k tokens but update appends one per row: only
            // process_MTPInfo knows how many drafts were accepted.
            if (o.num_decode_tokens != o.num_decodes)
              throw py::value_error("update: step " + std::to_string(s.step()) + " has speculative rows (" +
                                    std::to_string(o.num_decode_tokens - o.num_decodes) +
                                    " draft tokens scheduled): apply it with process_MTPInfo; nothing was changed");
            const auto rows = o.num_sample_rows;
            py::object token_holder;  // not py::array: its default constructor allocates an array
            std::vector<int32_t> token_scratch;
            const int32_t* const tokens =
                sampled_token_rows(sampled_token_ids, rows, s.config().vocab_size, token_holder, token_scratch);
            const float* lp = nullptr;
            if (!logprobs.is_none()) lp = buf::check_input_1d<float>(logprobs, "logprobs", rows).data;
            const int32_t* tk = nullptr;
            const float* tl = nullptr;
            int32_t k = 0;
            if (!topk_token_ids.is_none() || !topk_logprobs.is_none()) {
              if (topk_token_ids.is_none() || topk_logprobs.is_none())
                buf::fail("topk_token_ids", "topk_token_ids and topk_logprobs must be given together");
              auto a = buf::check_array<int32_t>(topk_token_ids, "topk_token_ids", 2, false);
              auto b = buf::check_array<float>(topk_logprobs, "topk_logprobs", 2, false);
              if (a.shape(0) != rows || b.shape(0) != rows || a.shape(1) != b.shape(1))
                buf::fail("topk_token_ids", "shapes " + buf::shape_str(a) + " and " + buf::shape_str(b) +
                                                " must both be (" + std::to_string(rows) + ", k)");
              tk = static_cast<const int32_t*>(a.data());
              tl = static_cast<const float*>(b.data());
              k = static_cast<int32_t>(a.shape(1));
            }
            const int32_t vocab = s.config().vocab_size;
            // Top-k ids that reach the outputs (the first `logprobs` of rows that ask) must be tokens.
            if (tk != nullptr && o.max_logprobs > 0) {
              int32_t r = 0;
              for (const auto& e : o.scheduled) {
                const int32_t want = s.store().seq(e.seq).wants_logprobs ? s.store().group_of(e.seq).params.logprobs : 0;
                for (int32_t j = 0; j < e.num_samples; ++j, ++r)
                  for (int32_t c = 0; c < std::min(want, k); ++c) {
                    const int32_t id = tk[static_cast<size_t>(r) * k + c];
                    if (id < 0 || id >= vocab)
                      buf::fail("topk_token_ids", "token id " + std::to_string(id) + " at row " + std::to_string(r) +
                                                      ", column " + std::to_string(c) +
                                                      " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
                  }
              }
            }
            for (int32_t r = 0; r < rows; ++r)
              if (tokens[r] < 0 || tokens[r] >= vocab)
                buf::fail("sampled_token_ids", "token id " + std::to_string(tokens[r]) + " at row " + std::to_string(r) +
                                                   " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
            // Rows whose request asks for more top-k logprobs than given (scan only on error).
            if (o.max_logprobs > k) {
              int32_t r = 0;
              for (const auto& e : o.scheduled) {
                // wants_logprobs lives on the sequence: the group is read only when it asks.
                const int32_t want = s.store().seq(e.seq).wants_logprobs ? s.store().group_of(e.seq).params.logprobs : -1;
                if (e.num_samples > 0 && want > 0 && want > k)
                  buf::fail("topk_token_ids", "row " + std::to_string(r) + " asks for " + std::to_string(want) +
                                                  " logprobs but k = " + std::to_string(k));
                r += e.num_samples;
              }
            }
            py::gil_scoped_release nogil;
            s.update(tokens, lp, tk, tl, k);
          },
          py::arg("sampled_token_ids"), py::arg("logprobs") = py::none(), py::arg("topk_token_ids") = py::none(),
          py::arg("topk_logprobs") = py::none(),
          "Apply the step's sampled tokens (releases the GIL). sampled_token_ids: num_sample_rows token ids, "
          "any 1-D integer array — an int32 C-contiguous numpy array is read in place (borrowed), another "
          "integer dtype or layout, a CPU tensor (DLPack) or a list is converted once; a non-integer dtype is a "
          "TypeError, a wrong length or an id outside the vocabulary a ValueError. Borrowed, read-only: logprobs float32[num_sample_rows] (sampled tokens' logprobs) or None; "
          "topk_token_ids int32[num_sample_rows, k] with topk_logprobs float32[num_sample_rows, k], or None. "
          "Advances computed tokens, registers full blocks in the prefix cache, forks n > 1 groups, appends "
          "tokens and applies stop conditions. Validates everything first (token ids and the top-k ids a row "
          "reports in the vocabulary, shapes): on error nothing changes. A step with draft rows (speculative "
          "decoding) is refused with ValueError: apply it with process_MTPInfo.")
      .def(
          "abandon_step",
          [](Scheduler& s, const std::string& action) {
            BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.abandon_step");
            bool fail = false;
            if (action == "fail") fail = true;
            else if (action != "recompute")
              buf::fail("action", "'" + action + "' is not 'recompute' or 'fail'");
            std::vector<GroupIndex> groups;
            {
              py::gil_scoped_release nogil;
              s.abandon_step(fail, groups);
            }
            std::vector<std::string> ids;
            ids.reserve(groups.size());
            for (GroupIndex g : groups) ids.push_back(s.store().groups[g].request_id);
            std::sort(ids.begin(), ids.end());
            return ids;
          },
          py::arg("action") = "recompute",
          "Abandon the step in flight after a failure (an exception in the model, the sampler or the output "
          "step; between schedule() and update() / process_MTPInfo), ending it so that schedule() works "
          "again. Nothing of the step is applied: update_prompt_logprobs rows already given are kept (they "
          "are values, not KV). action='recompute': every sequence of the step goes back to the preempted "
          "queue (blocks and state slot freed, tokens kept; the blocks the step was to write were never "
          "registered in the prefix cache) and is computed again later. action='fail': every request with a "
          "sequence in the step is finished, all its sequences, with SequenceStatus.FINISHED_ERROR "
          "(finish_reason 'error'); get_finished_seqs_info and build_request_outputs report them now. In both "
          "modes the sequences that the step's blocks_to_copy / states_to_clone / states_to_zero write (fork "
          "children, copy-on-write, new slots) are recomputed and that device work is dropped: nothing of "
          "the step reaches a later one. With a step scheduled ahead (step_ahead), both steps in flight are abandoned together. Returns the request ids concerned (failed, or with a recomputed "
          "sequence), sorted; [] and no change when no step is in flight (safe in any except clause). Raises "
          "ValueError naming action for any other value.")
      .def(
          "stop_sequence",
          [](Scheduler& s, int64_t seq_id, const std::string& stop_string, int32_t num_output_tokens,
             const py::object& output) {
            BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.stop_sequence");
            const SeqIndex i = seq_index_or_raise(s, seq_id);
            const Sequence& q = s.store().seq(i);
            if (num_output_tokens < 0 || num_output_tokens > q.num_output_tokens())
              buf::fail("num_output_tokens", std::to_string(num_output_tokens) + " is outside [0, " +
                                                 std::to_string(q.num_output_tokens()) + "]");
            RequestOutputData* d = nullptr;
            if (!output.is_none()) {
              if (!py::isinstance<RequestOutputData>(output))
                throw py::type_error("output: expected a RequestOutput or None, got " +
                                     std::string(py::str(py::type::of(output).attr("__name__"))));
              d = &output.cast<RequestOutputData&>();
              const std::string& rid = s.store().group_of(i).request_id;
              if (d->request_id != rid)
                buf::fail("output", "is the output of request '" + d->request_id + "', not of sequence " +
                                        std::to_string(seq_id) + "'s request '" + rid + "'");
            }
            const int32_t old_len = q.num_output_tokens();
            s.stop_sequence(i, stop_string, num_output_tokens);
            if (d) correct_output_after_stop(s, i, old_len, *d);
          },
          py::arg("seq_id"), py::arg("stop_string"), py::arg("num_output_tokens"), py::arg("output") = py::none(),
          "Finish a sequence for a stop string found by the detokenizer, keeping its first "
          "num_output_tokens output tokens (stop_reason = stop_string, finish_reason 'stop'); a sequence that "
          "already finished in this step (e.g. at max_tokens) becomes 'stop'. output: the RequestOutput of the "
          "sequence's request from the last build_request_outputs, or None. Given, it is corrected in place "
          "(the completion's tokens cut at the stop, its finish and stop reason, `finished` once every sample "
          "ended) and the request is not reported again: its outputs are built once. Without it the next "
          "build_request_outputs reports the request again. Raises ValueError for an unknown seq_id, a count "
          "outside [0, output length] or another request's output; TypeError for an output that is not a "
          "RequestOutput.")
      .def(
          "get_sequence",
          [](py::object self, int64_t seq_id) {
            Scheduler& s = self.cast<Scheduler&>();
            seq_index_or_raise(s, seq_id);
            return SeqHandle{self, &s, seq_id};
          },
          py::arg("seq_id"), "The live sequence with this id. Raises ValueError if unknown or released.")
      .def(
          "get_sequences",
          [](py::object self, const std::string& request_id) {
            Scheduler& s = self.cast<Scheduler&>();
            if (!s.has_request(request_id)) buf::fail("request_id", "unknown request id '" + request_id + "'");
            py::typing::List<SeqHandle> out;
            for (SeqIndex i : s.store().groups[s.group_index(request_id)].seqs)
              out.append(SeqHandle{self, &s, s.store().seq(i).seq_id});
            return out;
          },
          py::arg("request_id"), "The sequences of a request (parent first). Raises ValueError if unknown.")
      .def("has_unfinished_requests", [](const Scheduler& s) { return s.num_unfinished() > 0; },
           "Whether any request is not finished.")
      .def_property_readonly("num_unfinished_requests", &Scheduler::num_unfinished, "Requests not finished.")
      .def_property_readonly("num_running", [](const Scheduler& s) { return s.running().size(); },
                             "Running sequences.")
      .def_property_readonly("num_waiting", [](const Scheduler& s) { return s.waiting().size(); },
                             "Waiting (never scheduled) sequences.")
      .def_property_readonly("num_preempted", [](const Scheduler& s) { return s.preempted().size(); },
                             "Preempted sequences waiting to resume.")
      .def_property_readonly(
          "running_seq_ids",
          [](const Scheduler& s) {
            std::vector<int64_t> v;
            for (SeqIndex i : s.running()) v.push_back(s.store().seq(i).seq_id);
            return to_array(v);
          },
          "int64: running sequences in scheduling order.")
      .def_property_readonly(
          "waiting_seq_ids",
          [](const Scheduler& s) {
            // The two sorted queues merged as schedule() admits from them: by priority under the
            // 'priority' policy, a preempted sequence first on ties.
            std::vector<int64_t> v;
            const auto& p = s.preempted();
            const auto& w = s.waiting();
            const bool by_priority = s.config().policy == SchedulingPolicy::PRIORITY;
            size_t i = 0, j = 0;
            while (i < p.size() || j < w.size()) {
              bool take_p = i < p.size();
              if (take_p && j < w.size() && by_priority)
                take_p = s.store().group_of(p[i]).params.priority <= s.store().group_of(w[j]).params.priority;
              v.push_back(s.store().seq(take_p ? p[i++] : w[j++]).seq_id);
            }
            return to_array(v);
          },
          "int64: preempted and waiting sequences, in admission order (by priority under the 'priority' "
          "policy, preempted ones first on ties; then arrival_time and add order).")
      .def_property_readonly("step_ahead", &Scheduler::step_ahead,
                             "True while a step scheduled with schedule(overlap=True) runs ahead of the step "
                             "before it, whose update() is still due (two steps in flight).")
      .def_property_readonly("step_in_flight", &Scheduler::step_in_flight,
                             "True between schedule() and update() (with a step scheduled ahead: until the update of the newer step).")
      .def_property_readonly("block_manager", [](Scheduler& s) -> BlockManager& { return s.block_manager(); },
                             py::return_value_policy::reference_internal, "Its BlockManager.")
      .def_property_readonly("max_model_len", [](const Scheduler& s) { return s.config().max_model_len; },
                             "Max tokens per sequence.")
      .def_property_readonly("vocab_size", [](const Scheduler& s) { return s.config().vocab_size; }, "Vocabulary size.")
      .def("reset_prefix_cache", [](Scheduler& s) {
             BusyGuard busy_guard(s.busy, "Scheduler", "Scheduler.reset_prefix_cache");
             return s.reset_prefix_cache();
           },
           "Forget every cached block (e.g. after new weights). Returns True.")
      .def("get_stats", &scheduler_stats,
           "dict: num_running, num_waiting, num_preempted, num_preemptions_total, num_unfinished_requests, "
           "kv_usage, prefix_cache_hit_rate, prefix_cache_queries, prefix_cache_hits, num_free_blocks, "
           "num_cached_blocks, num_evictions, num_cow_copies.")
      .def("check_invariants", &Scheduler::check_invariants,
           "Debug/test check of every block and slot invariant (O(blocks + tokens)); returns '' when "
           "consistent, else the first violation.");

  // ---------------------------------------------------------------- fork
  m.def(
      "clone_and_zero_states_and_blocks",
      [](Scheduler& s, int64_t seq_id, int32_t num_children) {
        BusyGuard busy_guard(s.busy, "Scheduler", "clone_and_zero_states_and_blocks");
        const SeqIndex i = seq_index_or_raise(s, seq_id);
        const Sequence& q = s.store().seq(i);
        if (q.status != SequenceStatus::RUNNING)
          buf::fail("seq_id", std::to_string(seq_id) + " is not running (status " +
                                  std::to_string(static_cast<int>(q.status)) + ")");
        if (num_children < 1) buf::fail("num_children", std::to_string(num_children) + " must be >= 1");
        if (num_children > s.free_seq_units())
          buf::fail("num_children", std::to_string(num_children) + " exceeds the free max_num_seqs capacity " +
                                        std::to_string(s.free_seq_units()));
        if (q.state_slot >= 0 && num_children > s.num_free_state_slots())
          buf::fail("num_children", std::to_string(num_children) + " exceeds the free state slots " +
                                        std::to_string(s.num_free_state_slots()));
        std::vector<SeqIndex> children;
        std::vector<BlockCopy> copies, clones;
        std::vector<int32_t> zeros;
        s.fork(i, num_children, false, children, copies, clones, zeros);
        std::vector<int64_t> ids;
        for (SeqIndex c : children) ids.push_back(s.store().seq(c).seq_id);
        return py::make_tuple(to_array(ids), pairs_array(copies), pairs_array(clones), to_array(zeros));
      },
      py::arg("scheduler"), py::arg("seq_id"), py::arg("num_children"),
      "Fork a running sequence into num_children new sequences of its request: they share its full KV "
      "blocks (ref counts), get a copy of its partial last block (shared + copy-on-write when no block is "
      "free) and a clone of its state slot (a zeroed slot if it has no computed state). Returns (child "
      "seq ids int64[k], blocks_to_copy int32[m, 2], states_to_clone int32[c, 2], states_to_zero int32[z]) "
      "for the device to apply before the next forward. Scheduler.update calls the same C++ code after an "
      "n > 1 prompt. Raises ValueError for an unknown/non-running seq_id or no room for the children.");

}

}  // namespace deepinfer

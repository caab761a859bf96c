// Python bindings of the output family: RequestOutput (+ Completion), RequestOutputPool,
// build_request_outputs, get_finished_seqs_info.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/typing.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "python/bindings.h"
#include "python/request_output_pool.h"
#include "python/sequence_handle.h"

namespace deepinfer {

namespace {

py::list logprob_dicts(const int32_t* ids, const float* vals, size_t count, size_t per) {
  py::list out;
  for (size_t t = 0; t < count; ++t) {
    py::dict d;
    for (size_t j = 0; j < per; ++j) {
      const int32_t id = ids[t * per + j];
      if (id < 0) continue;
      py::int_ key(id);
      if (!d.contains(key)) d[key] = py::float_(vals[t * per + j]);
    }
    out.append(d);
  }
  return out;
}

}  // namespace

void bind_outputs(py::module_& m) {
  // ---------------------------------------------------------------- outputs
  py::class_<RequestOutputData> ro(m, "RequestOutput",
                                   "Output of one request after a step (from build_request_outputs; pooled). "
                                   "Fields are read on access; ``completion.text`` is written by the detokenizer.");
  py::class_<CompletionData>(ro, "Completion", "One sample of a RequestOutput (vLLM's CompletionOutput).")
      .def_readonly("index", &CompletionData::index, "Sample index in the request (0..n-1).")
      .def_property_readonly(
          "token_ids",
          [](const CompletionData& c) {
            py::list l(c.token_ids.size());
            for (size_t i = 0; i < c.token_ids.size(); ++i) l[i] = py::int_(c.token_ids[i]);
            return l;
          },
          "list[int]: generated tokens (all, or new ones in delta kind).")
      .def_property_readonly(
          "cumulative_logprob",
          [](const CompletionData& c) -> std::optional<double> {
            if (c.logprobs_per_token == 0) return std::nullopt;  // not asked for: vLLM's None, never a made-up 0.0
            return c.cumulative_logprob;
          },
          "Sum of the sampled tokens' logprobs; None when logprobs were not requested.")
      .def_property_readonly(
          "logprobs",
          [](const CompletionData& c) -> py::object {
            if (c.logprobs_per_token == 0) return py::none();
            const size_t per = c.logprobs_per_token;
            return logprob_dicts(c.logprob_token_ids.data(), c.logprob_values.data(), c.logprob_token_ids.size() / per, per);
          },
          "None when not requested; else per token {token_id: logprob}, sampled token first.")
      .def_property_readonly("finish_reason", [](const CompletionData& c) { return finish_reason_of(c.finish_reason); },
                             "'stop', 'length', 'abort', 'ignored', 'error' or None.")
      .def_property_readonly(
          "stop_reason", [](const CompletionData& c) { return stop_reason_of(c.stop_token, c.stop_string, c.stop_is_string); },
          "Stop token id, stop string (or the ignore reason), or None.")
      .def_property_readonly("finished", [](const CompletionData& c) { return c.finish_reason != nullptr; },
                             "Whether this sample finished.")
      .def_readwrite("text", &CompletionData::text, "Text, written by the Python detokenizer ('' until then).");

  ro.def_readonly("request_id", &RequestOutputData::request_id, "The request id.")
      .def_property_readonly(
          "prompt_token_ids",
          [](const RequestOutputData& d) {
            py::list l;
            if (d.prompt_token_ids)
              for (int32_t t : *d.prompt_token_ids) l.append(t);
            return l;
          },
          "list[int]: the prompt.")
      .def_readonly("finished", &RequestOutputData::finished, "Whether every sample finished.")
      .def_property_readonly(
          "outputs",
          [](py::object self) {
            auto& d = self.cast<RequestOutputData&>();
            py::typing::List<CompletionData> l;
            for (int32_t i = 0; i < d.num_completions; ++i)
              l.append(py::cast(&d.completions[i], py::return_value_policy::reference_internal, self));
            return l;
          },
          "list[RequestOutput.Completion]: one per sample in this output (delta kind: those with new tokens).")
      .def_property_readonly(
          "prompt_logprobs",
          [](const RequestOutputData& d) -> py::object {
            if (d.prompt_logprobs_per_token == 0) return py::none();
            py::list out;
            int32_t pos = d.prompt_logprobs_start;
            if (pos == 0 && d.prompt_logprobs_end > 0) {
              out.append(py::none());
              pos = 1;
            }
            const size_t per = d.prompt_logprobs_per_token;
            const size_t count = d.prompt_logprobs_end > pos ? d.prompt_logprobs_end - pos : 0;
            py::list rest = logprob_dicts(d.prompt_logprob_token_ids.data(), d.prompt_logprob_values.data(), count, per);
            for (auto x : rest) out.append(x);
            return out;
          },
          "None when not requested; else a list over the prompt positions covered (None for position 0, "
          "then {token_id: logprob} with the prompt token first).")
      .def_property_readonly(
          "metrics",
          [](const RequestOutputData& d) {
            py::typing::Dict<py::str, py::object> m;
            auto t = [](double v) -> py::object { return v > 0 ? py::object(py::float_(v)) : py::object(py::none()); };
            m["arrival_time"] = d.metrics.arrival_time;
            m["first_scheduled_time"] = t(d.metrics.first_scheduled_time);
            m["first_token_time"] = t(d.metrics.first_token_time);
            m["finished_time"] = t(d.metrics.finished_time);
            m["num_cached_tokens"] = d.metrics.num_cached_tokens;
            return m;
          },
          "dict: arrival_time, first_scheduled_time, first_token_time, finished_time (time.time() seconds or "
          "None), num_cached_tokens (prefix-cache hit tokens).")
      .def("__repr__", [](const RequestOutputData& d) {
        return "RequestOutput(request_id='" + d.request_id + "', outputs=" + std::to_string(d.num_completions) +
               ", finished=" + (d.finished ? "True" : "False") + ")";
      });

  py::class_<RequestOutputPool>(m, "RequestOutputPool",
                                "Recycles RequestOutput objects: one is reused by build_request_outputs once "
                                "nothing outside the pool references it.")
      .def(py::init([](int64_t max_size) {
             if (max_size < 0) buf::fail("max_size", std::to_string(max_size) + " must be >= 0");
             return new RequestOutputPool(static_cast<size_t>(max_size));
           }),
           py::arg("max_size") = 4096, "A pool keeping at most max_size objects.")
      .def("__len__", &RequestOutputPool::size, "Objects held.")
      .def_property_readonly("max_size", &RequestOutputPool::max_size, "Most objects kept.")
      .def(
          "add_columnar",
          [](RequestOutputPool& pool, const std::string& request_id, int64_t slot) {
            if (slot < 0 || slot > std::numeric_limits<int32_t>::max())
              buf::fail("slot", std::to_string(slot) + " must be in [0, 2**31 - 1]");
            if (!pool.columns().slots.emplace(request_id, static_cast<int32_t>(slot)).second)
              throw py::value_error("add_columnar: request '" + request_id + "' is registered already");
          },
          py::arg("request_id"), py::arg("slot"),
          "Register a request whose plain deltas build_request_outputs writes as rows of columns (read with "
          "take_columns) instead of RequestOutput objects: each output of the 'delta' kind with one sample (n == 1), "
          "no logprobs and no prompt logprobs, after the request's first output and not finished, becomes a row "
          "(slot, its new tokens, possibly none). Its other outputs (the first, the finished one, an abort) are "
          "RequestOutputs as before; building its finished output unregisters it. slot: the caller's number for "
          "the request (rows name it). ValueError for a slot outside [0, 2**31 - 1] or a request registered already.")
      .def(
          "discard_columnar", [](RequestOutputPool& pool, const std::string& request_id) {
            return pool.columns().slots.erase(request_id) > 0;
          },
          py::arg("request_id"), "Unregister a request (e.g. released); False when it was not registered.")
      .def_property_readonly(
          "num_columnar", [](RequestOutputPool& pool) { return pool.columns().slots.size(); },
          "Requests registered with add_columnar.")
      .def(
          "take_columns",
          [](RequestOutputPool& pool) -> std::tuple<py::array_t<int32_t>, py::array_t<int64_t>, py::array_t<int32_t>> {
            DeltaColumns& c = pool.columns();
            const auto rows = static_cast<py::ssize_t>(c.row_slots.size());
            py::array_t<int32_t> slots(rows), tokens(static_cast<py::ssize_t>(c.tokens.size()));
            py::array_t<int64_t> offsets(rows + 1);
            std::copy(c.row_slots.begin(), c.row_slots.end(), slots.mutable_data());
            std::copy(c.offsets.begin(), c.offsets.end(), offsets.mutable_data());
            std::copy(c.tokens.begin(), c.tokens.end(), tokens.mutable_data());
            c.clear_rows();
            return {slots, offsets, tokens};
          },
          "The rows build_request_outputs wrote since the last call, in build order, as three new arrays: "
          "(slots int32[R], offsets int64[R + 1], token_ids int32[T]); row r's new tokens are "
          "token_ids[offsets[r]:offsets[r + 1]] (offsets[0] == 0, offsets[R] == T). The rows are cleared.");

  m.def(
      "build_request_outputs",
      [](Scheduler& s, RequestOutputPool& pool) {
        BusyGuard busy_guard(s.busy, "Scheduler", "build_request_outputs");
        if (!s.outputs_ready())  // (a step scheduled ahead may run: the outputs are those of its predecessor)
          throw py::value_error("build_request_outputs: step " + std::to_string(s.update_target().step) +
                                " is waiting for update()");
        return py::typing::List<RequestOutputData>(request_output_list(s, pool));
      },
      py::arg("scheduler"), py::arg("pool"),
      "RequestOutputs of the requests updated since the previous call (or schedule()): new tokens, "
      "finishes, aborts, stop strings; per each request's output_kind (cumulative / delta / final_only). "
      "Objects come from pool; the plain deltas of the requests registered with pool.add_columnar are rows of "
      "pool.take_columns instead. Holds the GIL (creates Python objects).");

  m.def(
      "get_finished_seqs_info",
      [](const Scheduler& s) {
        BusyGuard busy_guard(s.busy, "Scheduler", "get_finished_seqs_info");
        const auto& f = s.finished();
        const size_t k = f.size();
        py::array_t<int64_t> ids(static_cast<py::ssize_t>(k));
        py::array_t<int32_t> status(static_cast<py::ssize_t>(k)), plen(static_cast<py::ssize_t>(k)),
            olen(static_cast<py::ssize_t>(k)), sample(static_cast<py::ssize_t>(k));
        py::list rids;
        for (size_t i = 0; i < k; ++i) {
          const Sequence& q = s.store().seq(f[i].seq);
          ids.mutable_data()[i] = f[i].seq_id;
          status.mutable_data()[i] = static_cast<int32_t>(q.status);
          plen.mutable_data()[i] = q.num_prompt_tokens;
          olen.mutable_data()[i] = q.num_output_tokens();
          sample.mutable_data()[i] = q.sample_index;
          rids.append(s.store().groups[q.group].request_id);
        }
        py::typing::Dict<py::str, py::object> d;
        d["seq_ids"] = ids;
        d["request_ids"] = rids;
        d["statuses"] = status;
        d["num_prompt_tokens"] = plen;
        d["num_output_tokens"] = olen;
        d["sample_indices"] = sample;
        return d;
      },
      py::arg("scheduler"),
      "Sequences finished since the last schedule() (update, aborts, stop strings, ignored prompts): dict "
      "of seq_ids int64[k], request_ids list[str], statuses int32[k] (SequenceStatus values), "
      "num_prompt_tokens int32[k], num_output_tokens int32[k], sample_indices int32[k].");
}

}  // namespace deepinfer

// Python bindings of the sequence family: PLACEHOLDER_REQUEST_ID, SequenceStatus, SequenceData,
// Sequence.
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "python/bindings.h"
#include "python/numpy_arrays.h"
#include "python/sequence_handle.h"

namespace deepinfer {

void bind_sequence_status(py::module_& m) {
  m.attr("PLACEHOLDER_REQUEST_ID") = py::str(kPlaceholderRequestId);

  py::native_enum<SequenceStatus>(m, "SequenceStatus", "enum.IntEnum",
                                  "Lifecycle of a sequence. FINISHED_* values are final.")
      .value("WAITING", SequenceStatus::WAITING, "Queued, never scheduled.")
      .value("RUNNING", SequenceStatus::RUNNING, "Holds KV blocks; scheduled when the budget allows.")
      .value("PREEMPTED", SequenceStatus::PREEMPTED, "Blocks freed (recompute); resumes before new requests of the same priority.")
      .value("FINISHED_STOPPED", SequenceStatus::FINISHED_STOPPED, "EOS, a stop token id or a stop string.")
      .value("FINISHED_LENGTH", SequenceStatus::FINISHED_LENGTH, "max_tokens or the max model length.")
      .value("FINISHED_ABORTED", SequenceStatus::FINISHED_ABORTED, "Aborted by request id.")
      .value("FINISHED_IGNORED", SequenceStatus::FINISHED_IGNORED, "Never scheduled: prompt too long.")
      .value("FINISHED_ERROR", SequenceStatus::FINISHED_ERROR,
             "Its request was failed by Scheduler.abandon_step(action='fail') (finish_reason 'error').")
      .finalize();
}

void bind_sequences(py::module_& m) {

  // ---------------------------------------------------------------- Sequence / SequenceData
  py::class_<SeqDataHandle>(m, "SequenceData",
                            "Token data of one sequence (a view by seq id; reads copy). Raises ValueError "
                            "once the sequence was released.")
      .def_property_readonly(
          "prompt_token_ids",
          [](const SeqDataHandle& h) { const auto& q = h.get(); return to_array(q.tokens.data(), q.num_prompt_tokens); },
          "int32 copy of the prompt.")
      .def_property_readonly(
          "output_token_ids",
          [](const SeqDataHandle& h) { const auto& q = h.get(); return to_array(q.output_tokens(), q.num_output_tokens()); },
          "int32 copy of the generated tokens.")
      .def_property_readonly("token_ids", [](const SeqDataHandle& h) { return to_array(h.get().tokens); },
                             "int32 copy of prompt + outputs.")
      .def_property_readonly("num_computed_tokens", [](const SeqDataHandle& h) { return h.get().num_computed_tokens; },
                             "Tokens whose KV is in the cache.")
      .def_property_readonly("cumulative_logprob", [](const SeqDataHandle& h) { return h.get().cumulative_logprob; },
                             "Sum of the sampled tokens' logprobs.")
      .def("get_len", [](const SeqDataHandle& h) { return h.get().num_tokens(); }, "Prompt + output length.")
      .def("get_prompt_len", [](const SeqDataHandle& h) { return h.get().num_prompt_tokens; }, "Prompt length.")
      .def("get_output_len", [](const SeqDataHandle& h) { return h.get().num_output_tokens(); }, "Output length.");

  py::class_<SeqHandle>(m, "Sequence",
                        "One sequence of a request (a view by seq id, from Scheduler.get_sequence / "
                        "get_sequences). Reads copy; raises ValueError once the sequence was released.")
      .def_readonly("seq_id", &SeqHandle::seq_id, "Sequence id (unique, never reused).")
      .def_property_readonly("request_id", [](const SeqHandle& h) { return h.group().request_id; }, "Its request.")
      .def_property_readonly("sample_index", [](const SeqHandle& h) { return h.get().sample_index; },
                             "Index among the request's n samples (0 = parent).")
      .def_property_readonly("status", [](const SeqHandle& h) { return h.get().status; }, "SequenceStatus.")
      .def_property_readonly("data", [](const SeqHandle& h) { return SeqDataHandle{h}; }, "Its SequenceData.")
      .def_property_readonly("num_prompt_tokens", [](const SeqHandle& h) { return h.get().num_prompt_tokens; },
                             "Prompt length.")
      .def_property_readonly("num_tokens", [](const SeqHandle& h) { return h.get().num_tokens(); },
                             "Prompt + output length.")
      .def_property_readonly("num_computed_tokens", [](const SeqHandle& h) { return h.get().num_computed_tokens; },
                             "Tokens whose KV is in the cache.")
      .def_property_readonly("num_cached_tokens", [](const SeqHandle& h) { return h.get().num_cached_tokens; },
                             "Prefix-cache hit tokens at its last admission.")
      .def_property_readonly("token_ids", [](const SeqHandle& h) { return to_array(h.get().tokens); },
                             "int32 copy of prompt + outputs.")
      .def_property_readonly(
          "output_token_ids",
          [](const SeqHandle& h) { const auto& q = h.get(); return to_array(q.output_tokens(), q.num_output_tokens()); },
          "int32 copy of the generated tokens.")
      .def_property_readonly("block_table", [](const SeqHandle& h) { return to_array(h.get().block_table); },
                             "int32 copy of its KV block ids.")
      .def_property_readonly("state_slot", [](const SeqHandle& h) { return h.get().state_slot; },
                             "Recurrent-state slot, -1 when none.")
      .def_property_readonly("draft_token_ids", [](const SeqHandle& h) { return to_array(h.get().draft_tokens); },
                             "int32 copy of the drafts to verify next step.")
      .def_property_readonly("is_finished", [](const SeqHandle& h) { return is_finished(h.get().status); },
                             "Whether its status is FINISHED_*.")
      .def_property_readonly("finish_reason", [](const SeqHandle& h) { return finish_reason_of(finish_reason_str(h.get().status)); },
                             "'stop', 'length', 'abort', 'ignored', 'error' or None.")
      .def_property_readonly(
          "stop_reason",
          [](const SeqHandle& h) { const auto& q = h.get(); return stop_reason_of(q.stop_token, q.stop_string, q.stop_is_string); },
          "Stop token id (int), stop string or ignore reason (str), or None.")
      .def_property_readonly("priority", [](const SeqHandle& h) { return h.group().params.priority; },
                             "Request priority (smaller = sooner).")
      .def_property_readonly("arrival_time", [](const SeqHandle& h) { return h.group().arrival_time; },
                             "Arrival time (time.time() seconds).")
      .def("__repr__", [](const SeqHandle& h) {
        const SeqIndex i = h.sched->find_seq(h.seq_id);
        if (i == kNoSeq) return "Sequence(seq_id=" + std::to_string(h.seq_id) + ", released)";
        const auto& q = h.sched->store().seq(i);
        return "Sequence(seq_id=" + std::to_string(h.seq_id) + ", request_id='" + h.group().request_id +
               "', tokens=" + std::to_string(q.num_tokens()) + ", computed=" + std::to_string(q.num_computed_tokens) + ")";
      });

}

}  // namespace deepinfer

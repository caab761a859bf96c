// Python bindings of the sampler-input family and prepare_sampler_inputs.
#include <pybind11/numpy.h>

#include "bindings_inputs.h"
#include "metadata.h"
#include "prepare_args.h"
#include "sampler_inputs.h"

namespace py = pybind11;

namespace deepinfer {

namespace {
// A read-only property returning a numpy view of the used prefix of a HostArray.
#define DI_ARRAY(cls, field, count, doc) \
  def_property_readonly(#field, [](const cls& s) { return s.field.view(static_cast<size_t>(count)); }, doc)
}  // namespace

void bind_sampler(py::module_& m) {
  py::class_<SamplingKernelInputs>(m, "SamplingKernelInputs", R"doc(
Per sample row parameters of the sampling kernel (numpy views of engine-owned memory; a view
keeps the step's data). Same seed and offset give the same token whatever the batch:
``seeds`` is the request's seed (or a fixed function of the engine's generator seed and the
sequence id), ``offsets`` the index of the output token being sampled, ``subsequences`` the
sample index within an n > 1 request.)doc")
      .def_readonly("num_rows", &SamplingKernelInputs::num_rows, "Sample rows (placeholders included).")
      .DI_ARRAY(SamplingKernelInputs, logits_rows, s.num_rows, "int32: logits row sampled by each sample row.")
      .DI_ARRAY(SamplingKernelInputs, temperature, s.num_rows, "float32: 0 = greedy.")
      .DI_ARRAY(SamplingKernelInputs, top_k, s.num_rows, "int32: -1 = off.")
      .DI_ARRAY(SamplingKernelInputs, top_p, s.num_rows, "float32: 1 = off.")
      .DI_ARRAY(SamplingKernelInputs, min_p, s.num_rows, "float32: 0 = off.")
      .DI_ARRAY(SamplingKernelInputs, seeds, s.num_rows, "int64: RNG seed of the row's request.")
      .DI_ARRAY(SamplingKernelInputs, offsets, s.num_rows, "int64: RNG offset = index of the output token sampled.")
      .DI_ARRAY(SamplingKernelInputs, subsequences, s.num_rows, "int32: RNG subsequence = sample index in the request.")
      .def_readonly("all_greedy", &SamplingKernelInputs::all_greedy, "Every real row is greedy (skip random sampling).")
      .def_readonly("all_random", &SamplingKernelInputs::all_random, "No real row is greedy.")
      .def_readonly("no_top_k", &SamplingKernelInputs::no_top_k, "No random row uses top-k.")
      .def_readonly("no_top_p", &SamplingKernelInputs::no_top_p, "No random row uses top-p.")
      .def_readonly("no_min_p", &SamplingKernelInputs::no_min_p, "No random row uses min-p.");

  py::class_<LogitsTransformInputs>(m, "LogitsTransformInputs", R"doc(
Logits transforms per sample row, sparse (CSR: ``*_offsets`` has num_rows + 1 entries; row r
owns ``[offsets[r], offsets[r + 1])`` of the value arrays). Penalties (vLLM semantics):
presence and frequency apply to tokens counted in the output, repetition to tokens in the
prompt or the output; ``penalty_token_ids`` lists each distinct token of the sequence once with
its output count and an in-prompt flag. ``banned_*``: tokens set to -inf (banned ids, plus EOS
and stop ids while the row is below min_tokens). ``allowed_*``: when a row's range is not
empty, every other token is set to -inf.)doc")
      .def_readonly("num_rows", &LogitsTransformInputs::num_rows, "Sample rows.")
      .DI_ARRAY(LogitsTransformInputs, presence_penalty, s.num_rows, "float32 per row.")
      .DI_ARRAY(LogitsTransformInputs, frequency_penalty, s.num_rows, "float32 per row.")
      .DI_ARRAY(LogitsTransformInputs, repetition_penalty, s.num_rows, "float32 per row (1 = off).")
      .DI_ARRAY(LogitsTransformInputs, penalty_offsets, s.num_rows + 1, "int32 CSR offsets of the penalty token lists.")
      .DI_ARRAY(LogitsTransformInputs, penalty_token_ids, s.penalty_offsets.data ? s.penalty_offsets.data[s.num_rows] : 0, "int32 distinct token ids.")
      .DI_ARRAY(LogitsTransformInputs, penalty_output_counts, s.penalty_offsets.data ? s.penalty_offsets.data[s.num_rows] : 0, "int32 occurrences in the output.")
      .DI_ARRAY(LogitsTransformInputs, penalty_in_prompt, s.penalty_offsets.data ? s.penalty_offsets.data[s.num_rows] : 0, "uint8 1 if the token occurs in the prompt.")
      .DI_ARRAY(LogitsTransformInputs, penalty_pending_source, s.num_rows,
                "int32 ZOS: logits row of the previous step whose sampled token is also an output token of this row "
                "(add it to the counts on the device); -1 none.")
      .DI_ARRAY(LogitsTransformInputs, bias_offsets, s.num_rows + 1, "int32 CSR offsets of the logit bias.")
      .DI_ARRAY(LogitsTransformInputs, bias_token_ids, s.bias_offsets.data ? s.bias_offsets.data[s.num_rows] : 0, "int32.")
      .DI_ARRAY(LogitsTransformInputs, bias_values, s.bias_offsets.data ? s.bias_offsets.data[s.num_rows] : 0, "float32 added to the logits.")
      .DI_ARRAY(LogitsTransformInputs, banned_offsets, s.num_rows + 1, "int32 CSR offsets of masked tokens.")
      .DI_ARRAY(LogitsTransformInputs, banned_token_ids, s.banned_offsets.data ? s.banned_offsets.data[s.num_rows] : 0, "int32, sorted per row.")
      .DI_ARRAY(LogitsTransformInputs, allowed_offsets, s.num_rows + 1, "int32 CSR offsets of allowed tokens.")
      .DI_ARRAY(LogitsTransformInputs, allowed_token_ids, s.allowed_offsets.data ? s.allowed_offsets.data[s.num_rows] : 0, "int32, sorted per row.")
      .def_readonly("no_penalties", &LogitsTransformInputs::no_penalties, "No row has a penalty.")
      .def_readonly("no_logit_bias", &LogitsTransformInputs::no_logit_bias, "No row has a logit bias.")
      .def_readonly("no_banned", &LogitsTransformInputs::no_banned, "No row masks tokens.")
      .def_readonly("no_allowed", &LogitsTransformInputs::no_allowed, "No row restricts to allowed tokens.");

  py::class_<PrefillSamplingInputs>(m, "PrefillSamplingInputs", "Sample rows of sequences completing their prompt this step.")
      .def_readonly("num_rows", &PrefillSamplingInputs::num_rows, "Number of prefill sample rows.")
      .DI_ARRAY(PrefillSamplingInputs, sample_rows, s.num_rows, "int32 sample-row indices.");
  py::class_<DecodeSamplingInputs>(m, "DecodeSamplingInputs",
                                   "Sample rows of decode sequences, followed by the placeholder rows that pad a "
                                   "decode-only step to its graph batch size.")
      .def_readonly("num_rows", &DecodeSamplingInputs::num_rows, "Decode sample rows, padding included.")
      .def_readonly("num_real_rows", &DecodeSamplingInputs::num_real_rows, "Decode sample rows without padding.")
      .DI_ARRAY(DecodeSamplingInputs, sample_rows, s.num_rows, "int32 sample-row indices.");
  py::class_<DriverSamplingInputs>(m, "DriverSamplingInputs",
                                   "What the driver needs to read results back: per sample row its sequence and "
                                   "logprobs request. Pass tokens[:num_real_rows] to Scheduler.update (placeholder "
                                   "rows are last).")
      .def_readonly("num_rows", &DriverSamplingInputs::num_rows, "Sample rows.")
      .def_readonly("num_real_rows", &DriverSamplingInputs::num_real_rows, "Sample rows of real sequences.")
      .def_readonly("max_num_logprobs", &DriverSamplingInputs::max_num_logprobs, "Largest top-k of logprobs requested, -1 none.")
      .DI_ARRAY(DriverSamplingInputs, seq_ids, s.num_rows, "int64 seq_id, -1 for placeholders.")
      .DI_ARRAY(DriverSamplingInputs, batch_rows, s.num_rows, "int32 batch row of each sample row.")
      .DI_ARRAY(DriverSamplingInputs, num_logprobs, s.num_rows, "int32 logprobs requested, -1 none.");
  py::class_<SpeculativeSamplingInputs>(m, "SpeculativeSamplingInputs",
                                        "Rejection-sampling inputs of speculative decode rows: per sequence its "
                                        "drafts (CSR by cu_num_drafts), the logits row verifying each draft and "
                                        "the bonus-token logits row.")
      .def_readonly("num_seqs", &SpeculativeSamplingInputs::num_seqs, "Speculative sequences.")
      .def_readonly("num_drafts_total", &SpeculativeSamplingInputs::num_drafts_total, "Draft tokens in all.")
      .DI_ARRAY(SpeculativeSamplingInputs, sample_rows, s.num_seqs, "int32 sample row of each sequence.")
      .DI_ARRAY(SpeculativeSamplingInputs, num_drafts, s.num_seqs, "int32 drafts per sequence.")
      .DI_ARRAY(SpeculativeSamplingInputs, cu_num_drafts, s.num_seqs + 1, "int32 offsets into draft_token_ids.")
      .DI_ARRAY(SpeculativeSamplingInputs, draft_token_ids, s.num_drafts_total, "int32 draft tokens.")
      .DI_ARRAY(SpeculativeSamplingInputs, target_logits_rows, s.num_drafts_total, "int32 logits row that verifies each draft.")
      .DI_ARRAY(SpeculativeSamplingInputs, bonus_logits_rows, s.num_seqs, "int32 logits row of the bonus token.");
  py::class_<PromptLogprobInputs>(m, "PromptLogprobInputs",
                                  "Logits rows that give prompt logprobs: row k's log-softmax scores the prompt "
                                  "token at positions[k] (target_token_ids[k]).")
      .def_readonly("num_rows", &PromptLogprobInputs::num_rows, "Prompt-logprob rows.")
      .def_readonly("max_num_logprobs", &PromptLogprobInputs::max_num_logprobs, "Largest top-k requested, -1 none.")
      .DI_ARRAY(PromptLogprobInputs, logits_rows, s.num_rows, "int32 logits rows.")
      .DI_ARRAY(PromptLogprobInputs, target_token_ids, s.num_rows, "int32 prompt token scored.")
      .DI_ARRAY(PromptLogprobInputs, positions, s.num_rows, "int32 its prompt position (1..P-1).")
      .DI_ARRAY(PromptLogprobInputs, batch_rows, s.num_rows, "int32 batch row.")
      .DI_ARRAY(PromptLogprobInputs, seq_ids, s.num_rows, "int64 sequence id.")
      .DI_ARRAY(PromptLogprobInputs, num_logprobs, s.num_rows, "int32 top-k requested.");

  py::class_<SamplerInputs>(m, "SamplerInputs", R"doc(
Everything the sampler needs for one step; reused step after step (engine-owned numpy
storage that grows when needed — a view taken earlier keeps its own data). Filled by
prepare_sampler_inputs.)doc")
      .def(py::init<uint64_t>(), py::arg("generator_seed") = 0,
           "generator_seed: derives the RNG seed of requests without a seed (fixed per sequence).")
      .def_property_readonly("kernel", [](SamplerInputs& s) -> SamplingKernelInputs& { return s.kernel; },
                             py::return_value_policy::reference_internal, "SamplingKernelInputs.")
      .def_property_readonly("transform", [](SamplerInputs& s) -> LogitsTransformInputs& { return s.transform; },
                             py::return_value_policy::reference_internal, "LogitsTransformInputs.")
      .def_property_readonly("prefill", [](SamplerInputs& s) -> PrefillSamplingInputs& { return s.prefill; },
                             py::return_value_policy::reference_internal, "PrefillSamplingInputs.")
      .def_property_readonly("decode", [](SamplerInputs& s) -> DecodeSamplingInputs& { return s.decode; },
                             py::return_value_policy::reference_internal, "DecodeSamplingInputs.")
      .def_property_readonly("driver", [](SamplerInputs& s) -> DriverSamplingInputs& { return s.driver; },
                             py::return_value_policy::reference_internal, "DriverSamplingInputs.")
      .def_property_readonly("speculative", [](SamplerInputs& s) -> SpeculativeSamplingInputs& { return s.speculative; },
                             py::return_value_policy::reference_internal, "SpeculativeSamplingInputs.")
      .def_property_readonly("prompt_logprobs", [](SamplerInputs& s) -> PromptLogprobInputs& { return s.prompt_logprobs; },
                             py::return_value_policy::reference_internal, "PromptLogprobInputs.")
      .def_readonly("generator_seed", &SamplerInputs::generator_seed, "Seed source of unseeded requests.");

  m.def(
      "prepare_sampler_inputs",
      [](const PrepareArgs& args, SequenceMetadataPool& metadata, SamplerInputs& out) -> SamplerInputs& {
        prepare_sampler_inputs(out, args, metadata);
        return out;
      },
      py::arg("args"), py::arg("metadata"), py::arg("out"), py::return_value_policy::reference,
      R"doc(Fill `out` (a SamplerInputs) for the step last prepared with `args` from `metadata` (the
same pool, unchanged since; ValueError otherwise). One sample row per sampled token in batch
order, then one placeholder row per padding batch row. Returns `out`. Releases the GIL while
building; grows engine-owned storage with the GIL held.)doc");
}

}  // namespace deepinfer

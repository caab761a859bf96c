// Python bindings of the sampler-input family and prepare_sampler_inputs.
#include <pybind11/numpy.h>

#include <optional>
#include <string>

#include "bindings_inputs.h"
#include "metadata.h"
#include "prepare_args.h"
#include "sampler_inputs.h"
#include "scheduler.h"

namespace py = pybind11;

namespace deepinfer {

namespace {
// A read-only property returning a numpy view of the used prefix of a HostArray.
#define DI_ARRAY(cls, field, count, doc) \
  def_property_readonly(#field, [](const cls& s) { return s.field.view(static_cast<size_t>(count)); }, doc)
}  // namespace

void bind_sampler(py::module_& m) {
  py::class_<SamplingKernelInputs>(m, "SamplingKernelInputs", R"doc(
Per sample row parameters of the sampling kernel (read-only numpy views of engine-owned memory,
valid until the next prepare_sampler_inputs with the same SamplerInputs). Same seed and offset give the same token whatever the batch:
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
prompt or the output. Their token counts come in one of two forms, by the SamplerInputs'
``penalty_counts`` mode:

* "full": ``penalty_token_ids`` lists each distinct token of the row's sequence once with its
  output count and an in-prompt flag, every step; ``penalty_slots`` is all -1 and there are no
  updates (``num_penalty_updates`` = 0, ``num_penalty_slots`` = 0).
* "incremental": the consumer keeps one table per slot (output count and in-prompt flag per
  token of the vocabulary); ``penalty_slots`` gives each row's slot and ``penalty_update_*``
  what changed in the tables this step, which the consumer applies in order before reading them
  (CSR over ``num_penalty_updates`` slots: zero the slot when ``penalty_update_reset``, then for
  each entry add 1 to the token's output count when ``penalty_update_is_output``, else mark it
  as in the prompt; duplicates accumulate). ``penalty_offsets`` is all 0 and the full lists are
  empty. Every call's updates must be applied, in call order (see
  SamplerInputs.reset_penalty_tables).

``penalty_pending_source`` (ZOS, both modes) is counted by the device for this step only: it
is never in the tables or the full lists yet (the host sends it once it knows the token).
``banned_*``: tokens set to -inf (banned ids, plus EOS and stop ids while the row is below
min_tokens). ``allowed_*``: when a row's range is not empty, every other token is set to -inf.)doc")
      .def_readonly("num_rows", &LogitsTransformInputs::num_rows, "Sample rows.")
      .DI_ARRAY(LogitsTransformInputs, presence_penalty, s.num_rows, "float32 per row.")
      .DI_ARRAY(LogitsTransformInputs, frequency_penalty, s.num_rows, "float32 per row.")
      .DI_ARRAY(LogitsTransformInputs, repetition_penalty, s.num_rows, "float32 per row (1 = off).")
      .DI_ARRAY(LogitsTransformInputs, penalty_offsets, s.num_rows + 1,
                "int32 CSR offsets of the full penalty token lists (\"full\" mode; all 0 in \"incremental\" mode).")
      .DI_ARRAY(LogitsTransformInputs, penalty_token_ids, s.penalty_offsets.data ? s.penalty_offsets.data[s.num_rows] : 0,
                "int32 distinct token ids (\"full\" mode; empty in \"incremental\" mode).")
      .DI_ARRAY(LogitsTransformInputs, penalty_output_counts, s.penalty_offsets.data ? s.penalty_offsets.data[s.num_rows] : 0,
                "int32 occurrences in the output (\"full\" mode; empty in \"incremental\" mode).")
      .DI_ARRAY(LogitsTransformInputs, penalty_in_prompt, s.penalty_offsets.data ? s.penalty_offsets.data[s.num_rows] : 0,
                "uint8 1 if the token occurs in the prompt (\"full\" mode; empty in \"incremental\" mode).")
      .DI_ARRAY(LogitsTransformInputs, penalty_pending_source, s.num_rows,
                "int32 ZOS: logits row of the previous step whose sampled token is also an output token of this row "
                "(add it to the counts on the device for this step only: it is not in the tables, a later step's "
                "update sends it); -1 none.")
      .DI_ARRAY(LogitsTransformInputs, penalty_slots, s.num_rows,
                "int32 per row: the slot whose table holds the counts of the row's sequence (\"incremental\" mode; "
                "rows of one n > 1 prompt share it); -1 for rows without penalties, placeholders and \"full\" mode.")
      .def_readonly("num_penalty_updates", &LogitsTransformInputs::num_penalty_updates,
                    "Slots updated this step (U; 0 in \"full\" mode).")
      .def_readonly("num_penalty_slots", &LogitsTransformInputs::num_penalty_slots,
                    "Slot ids in use are below this (the consumer grows its tables to it; 0 in \"full\" mode). It "
                    "never decreases, except after SamplerInputs.reset_penalty_tables().")
      .DI_ARRAY(LogitsTransformInputs, penalty_update_slots, s.num_penalty_updates, "int32 [U]: the slot of each update.")
      .DI_ARRAY(LogitsTransformInputs, penalty_update_reset, s.num_penalty_updates,
                "uint8 [U]: 1 = zero the slot's table before applying its entries (a new or reused slot, or a "
                "sequence that shrank / changed its prompt length: its entries list the whole sequence).")
      .DI_ARRAY(LogitsTransformInputs, penalty_update_offsets, s.num_penalty_updates + 1,
                "int32 [U + 1]: CSR offsets of each update's entries.")
      .DI_ARRAY(LogitsTransformInputs, penalty_update_token_ids,
                s.penalty_update_offsets.data ? s.penalty_update_offsets.data[s.num_penalty_updates] : 0,
                "int32: raw tokens appended to the sequence since the slot was last sent (in order, duplicates "
                "possible: accumulate).")
      .DI_ARRAY(LogitsTransformInputs, penalty_update_is_output,
                s.penalty_update_offsets.data ? s.penalty_update_offsets.data[s.num_penalty_updates] : 0,
                "uint8: 1 = add 1 to the token's output count, 0 = mark the token as in the prompt.")
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
storage that grows when needed). Its arrays are read-only views, valid until the next
prepare_sampler_inputs with this object: that call rewrites them (copy what must outlive it);
they never dangle. Filled by prepare_sampler_inputs.)doc")
      .def(py::init([](uint64_t generator_seed, const std::string& penalty_counts) {
             PenaltyCountsMode mode;
             if (penalty_counts == "incremental") mode = PenaltyCountsMode::INCREMENTAL;
             else if (penalty_counts == "full") mode = PenaltyCountsMode::FULL;
             else throw py::value_error("penalty_counts: '" + penalty_counts + "' is not one of 'incremental', 'full'");
             return SamplerInputs(generator_seed, mode);
           }),
           py::arg("generator_seed") = 0, py::kw_only(), py::arg("penalty_counts") = "incremental",
           R"doc(generator_seed: derives the RNG seed of requests without a seed (fixed per sequence).
penalty_counts: how penalty token counts reach the consumer (see LogitsTransformInputs):
"incremental" (default) sends each step only the tokens appended since the last call, for tables
the consumer keeps per slot; "full" sends every penalized sequence's distinct tokens with their
counts each step (stateless consumer, slower). ValueError for any other value.
In "incremental" mode one SamplerInputs feeds one consumer, which must apply every call's updates
in call order; skipping one desynchronises the tables (reset_penalty_tables() recovers).)doc")
      .def_property_readonly("penalty_counts", [](const SamplerInputs& s) {
             return std::string(s.penalty_mode == PenaltyCountsMode::INCREMENTAL ? "incremental" : "full");
           }, "\"incremental\" or \"full\" (set at construction).")
      .def("reset_penalty_tables", [](SamplerInputs& s) {
             BusyGuard guard(s.busy, "SamplerInputs", "SamplerInputs.reset_penalty_tables");
             s.reset_penalty_tables();
           },
           "Forget every penalty slot: the next prepare_sampler_inputs sends each penalized sequence whole, with "
           "reset = 1, in slots numbered from 0 again. For a consumer that lost or reallocated its tables (or missed a "
           "call). Harmless in \"full\" mode.")
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
      .def_readonly("generator_seed", &SamplerInputs::generator_seed, "Seed source of unseeded requests.")
      .def_readonly("num_calls", &SamplerInputs::num_calls,
                    "prepare_sampler_inputs calls that filled this object so far (rejected calls not counted): a "
                    "consumer of incremental penalty updates checks it grows by exactly 1 between the calls it "
                    "applies.");

  m.def(
      "prepare_sampler_inputs",
      [](const PrepareArgs& args, SequenceMetadataPool& metadata, SamplerInputs& out) -> SamplerInputs& {
        const char* call = "prepare_sampler_inputs";
        BusyGuard out_guard(out.busy, "SamplerInputs", call);
        BusyGuard args_guard(args.busy, "PrepareArgs", call);
        BusyGuard pool_guard(metadata.busy, "SequenceMetadataPool", call);
        std::optional<BusyGuard> sched_guard;  // reads the sequences of the pool's scheduler
        if (metadata.source()) sched_guard.emplace(metadata.source()->busy, "Scheduler", call);
        prepare_sampler_inputs(out, args, metadata);
        return out;
      },
      py::arg("args"), py::arg("metadata"), py::arg("out"), py::return_value_policy::reference,
      R"doc(Fill `out` (a SamplerInputs) for the step last prepared with `args` from `metadata` (the
same pool, unchanged since; ValueError otherwise). One sample row per sampled token in batch
order, then one placeholder row per padding batch row. Returns `out`. Releases the GIL while
building; grows engine-owned storage with the GIL held. In "incremental" penalty_counts mode the
call also hands slots to newly penalized sequences and frees (at its end) the slots of sequences
absent from this step; the consumer must apply this call's penalty updates before the next
call. A rejected call changes no slot.)doc");
}

}  // namespace deepinfer

// Python bindings of the update-side calls: process_MTPInfo, update_prompt_logprobs.
#include <pybind11/numpy.h>

#include "python/bindings.h"
#include "python/buffer_check.h"
#include "step/mtp.h"
#include "step/prompt_logprobs.h"

namespace py = pybind11;

namespace deepinfer {

void bind_updates(py::module_& m) {
  m.def(
      "process_MTPInfo",
      [](Scheduler& s, const py::object& num_accepted, const py::object& output_tokens, const py::object& next_drafts,
         const py::object& logprobs, const py::object& topk_token_ids, const py::object& topk_logprobs) {
        BusyGuard busy_guard(s.busy, "Scheduler", "process_MTPInfo");
        if (!s.step_in_flight()) throw py::value_error("scheduler: no scheduled step (call schedule() first)");
        if (s.step_ahead())
          throw py::value_error("process_MTPInfo: step " + std::to_string(s.step()) + " runs ahead of step " +
                                std::to_string(s.update_target().step) +
                                " (schedule(overlap=True)); apply step " + std::to_string(s.update_target().step) +
                                " with update() first (speculative steps never run ahead)");
        const SchedulerOutputs& out = s.last_outputs();
        const int32_t rows = out.num_sample_rows;
        auto acc = buf::check_input_1d<int32_t>(num_accepted, "num_accepted", rows);
        py::array toks = buf::check_array<int32_t>(output_tokens, "output_tokens", 2, false);
        if (toks.shape(0) != rows)
          buf::fail("output_tokens", "expected " + std::to_string(rows) + " rows, got shape " + buf::shape_str(toks));
        const int32_t cols = static_cast<int32_t>(toks.shape(1));
        const int32_t* tok = static_cast<const int32_t*>(toks.data());
        const float* lp = nullptr;
        if (!logprobs.is_none()) {
          py::array l = buf::check_array<float>(logprobs, "logprobs", 2, false);
          if (l.shape(0) != rows || l.shape(1) != cols)
            buf::fail("logprobs", "expected shape (" + std::to_string(rows) + ", " + std::to_string(cols) + "), got " +
                                      buf::shape_str(l));
          lp = static_cast<const float*>(l.data());
        }
        const int32_t* tk_ids = nullptr;
        const float* tk_lp = nullptr;
        int32_t topk = 0;
        if (!topk_token_ids.is_none() || !topk_logprobs.is_none()) {
          if (topk_token_ids.is_none() || topk_logprobs.is_none())
            buf::fail("topk_token_ids", "topk_token_ids and topk_logprobs must be given together");
          py::array a = buf::check_array<int32_t>(topk_token_ids, "topk_token_ids", 3, false);
          py::array b = buf::check_array<float>(topk_logprobs, "topk_logprobs", 3, false);
          if (a.shape(0) != rows || a.shape(1) != cols || b.shape(0) != rows || b.shape(1) != cols ||
              a.shape(2) != b.shape(2))
            buf::fail("topk_token_ids", "shapes " + buf::shape_str(a) + " and " + buf::shape_str(b) + " must both be (" +
                                            std::to_string(rows) + ", " + std::to_string(cols) + ", k)");
          tk_ids = static_cast<const int32_t*>(a.data());
          tk_lp = static_cast<const float*>(b.data());
          topk = static_cast<int32_t>(a.shape(2));
        }
        const int32_t* nd = nullptr;
        int32_t next_k = 0;
        if (!next_drafts.is_none()) {
          py::array d = buf::check_array<int32_t>(next_drafts, "next_drafts", 2, false);
          if (d.shape(0) != rows)
            buf::fail("next_drafts", "expected " + std::to_string(rows) + " rows, got shape " + buf::shape_str(d));
          nd = static_cast<const int32_t*>(d.data());
          next_k = static_cast<int32_t>(d.shape(1));
        }
        const int32_t vocab = s.config().vocab_size;
        // One entry per sample row (an n > 1 prompt completion has n rows, no drafts).
        int32_t r = 0;
        for (const ScheduledSeq& e : out.scheduled) {
          const int32_t k = e.is_prefill ? 0 : e.num_tokens - 1;
          for (int32_t sample = 0; sample < e.num_samples; ++sample, ++r) {
            const int32_t a = acc.data[r];
            if (a < 0 || a > k)
              buf::fail("num_accepted", "row " + std::to_string(r) + ": " + std::to_string(a) + " is outside [0, " +
                                            std::to_string(k) + "] (its draft count)");
            if (a + 1 > cols)
              buf::fail("output_tokens", "row " + std::to_string(r) + " needs " + std::to_string(a + 1) +
                                             " columns, got " + std::to_string(cols));
            for (int32_t j = 0; j <= a; ++j) {
              const int32_t t = tok[static_cast<size_t>(r) * cols + j];
              if (t < 0 || t >= vocab)
                buf::fail("output_tokens", "token id " + std::to_string(t) + " at row " + std::to_string(r) +
                                               ", column " + std::to_string(j) + " is outside the vocabulary [0, " +
                                               std::to_string(vocab) + ")");
            }
            bool padding = false;  // -1 ends a row's drafts: only -1 may follow
            for (int32_t j = 0; j < next_k; ++j) {
              const int32_t t = nd[static_cast<size_t>(r) * next_k + j];
              if (t == -1) {
                padding = true;
                continue;
              }
              if (t < 0 || t >= vocab || padding)
                buf::fail("next_drafts", "token id " + std::to_string(t) + " at row " + std::to_string(r) +
                                             (padding ? " follows a -1 (the end of the row's drafts)"
                                                      : " is outside the vocabulary [0, " + std::to_string(vocab) + ")"));
            }
          }
        }
        py::array_t<int32_t> appended(rows);
        int32_t* app = appended.mutable_data();
        {
          py::gil_scoped_release nogil;
          process_mtp_step(s, acc.data, tok, cols, lp, nd, next_k, app, tk_ids, tk_lp, topk);
        }
        return appended;
      },
      py::arg("scheduler"), py::arg("num_accepted"), py::arg("output_tokens"), py::arg("next_drafts") = py::none(),
      py::arg("logprobs") = py::none(), py::arg("topk_token_ids") = py::none(), py::arg("topk_logprobs") = py::none(),
      R"doc(Apply a speculative-decoding step (MTP heads or any drafter) instead of Scheduler.update.

One entry per SAMPLE row r, in the Scheduler's order (SchedulerOutputs.num_sample_rows rows,
each scheduled sequence contributing num_samples rows, the order prepare_sampler_inputs emits
them): num_accepted int32[R] (accepted drafts, 0..k of that row; 0 for rows without drafts),
output_tokens int32[R, C] (the accepted drafts then the bonus/recovered token in columns
0..num_accepted[r]), next_drafts int32[R, k'] or None (the drafts to verify next step; a row with fewer drafts
ends them with -1, and only -1 may follow), logprobs float32[R, C] or None, topk_token_ids
int32[R, C, K] and topk_logprobs float32[R, C, K] or None (the top-K logprobs of each appended
token, for sequences that asked logprobs = K; given together). All borrowed read-only, C-contiguous.
Appends the tokens one by one with the Scheduler's stop checking (a stop inside the run drops
the later tokens), advances computed tokens by 1 + accepted, rolls back the KV slots of
rejected drafts, stores the next drafts. The chunk completing an n > 1 prompt has n sample
rows and no drafts (num_accepted 0): it is forked exactly as Scheduler.update forks it (children
share the parent's full blocks; the copy of its partial last block and state clones are queued
for the next step's blocks_to_copy / states_to_clone / states_to_zero), then row j's token (and
next drafts) go to sample j (j = 0 the parent, then the children in creation order). Returns
int32[R]: tokens appended per row (0 for rows of sequences aborted while the step ran).
Validates everything first (nothing changes on error: ValueError naming the argument and row);
releases the GIL while applying.)doc");

  m.def(
      "update_prompt_logprobs",
      [](Scheduler& s, const SamplerInputs& sampler_inputs, const py::object& logprobs, const py::object& topk_token_ids,
         const py::object& topk_logprobs) {
        BusyGuard busy_guard(s.busy, "Scheduler", "update_prompt_logprobs");
        BusyGuard inputs_guard(sampler_inputs.busy, "SamplerInputs", "update_prompt_logprobs");
        const PromptLogprobInputs& in = sampler_inputs.prompt_logprobs;
        auto lp = buf::check_input_1d<float>(logprobs, "logprobs", in.num_rows);
        const int32_t* tk = nullptr;
        const float* tl = nullptr;
        int32_t k = 0;
        if (!topk_token_ids.is_none() || !topk_logprobs.is_none()) {
          if (topk_token_ids.is_none() || topk_logprobs.is_none())
            buf::fail("topk_token_ids", "topk_token_ids and topk_logprobs must be given together");
          py::array a = buf::check_array<int32_t>(topk_token_ids, "topk_token_ids", 2, false);
          py::array b = buf::check_array<float>(topk_logprobs, "topk_logprobs", 2, false);
          if (a.shape(0) != in.num_rows || b.shape(0) != in.num_rows || a.shape(1) != b.shape(1))
            buf::fail("topk_token_ids", "shapes " + buf::shape_str(a) + " and " + buf::shape_str(b) + " must both be (" +
                                            std::to_string(in.num_rows) + ", k)");
          tk = static_cast<const int32_t*>(a.data());
          tl = static_cast<const float*>(b.data());
          k = static_cast<int32_t>(a.shape(1));
        }
        update_prompt_logprobs(s, in, lp.data, tk, tl, k);
      },
      py::arg("scheduler"), py::arg("sampler_inputs"), py::arg("logprobs"), py::arg("topk_token_ids") = py::none(),
      py::arg("topk_logprobs") = py::none(),
      R"doc(Attach the prompt logprobs computed for this step's prefill chunks to their requests.

sampler_inputs: the step's SamplerInputs (its prompt_logprobs rows say which prompt position
each row scores). logprobs float32[N]: logprob of each row's target prompt token;
topk_token_ids int32[N, k] + topk_logprobs float32[N, k] (k >= the largest top-k requested)
or None when every request asked for 0. Chunks must arrive in order (each request continues at
its next prompt position), else ValueError naming the row; nothing is written on error. Call it
before Scheduler.update of the same step (so requests finishing there are still live).)doc");
}

}  // namespace deepinfer

#include "step/mtp.h"

namespace deepinfer {

namespace {

// Applies sample row r to sequence `seq` whose computed tokens were already advanced: appends the
// accepted drafts and the bonus token until a stop, frees the slots of rejected drafts, stores
// the next drafts.
void apply_sample_row(Scheduler& s, SeqIndex seq, int32_t r, const int32_t* num_accepted, const int32_t* output_tokens,
                      int32_t out_cols, const float* logprobs, const int32_t* next_drafts, int32_t next_k,
                      int32_t* num_appended, const int32_t* topk_ids, const float* topk_logprobs, int32_t topk_k) {
  const int32_t acc = num_accepted[r];
  const int32_t* toks = output_tokens + static_cast<size_t>(r) * out_cols;
  const float* lps = logprobs ? logprobs + static_cast<size_t>(r) * out_cols : nullptr;
  bool finished = false;
  for (int32_t j = 0; j <= acc && !finished; ++j) {
    const size_t tk = (static_cast<size_t>(r) * out_cols + j) * static_cast<size_t>(topk_k);
    finished = s.append_token(seq, toks[j], lps ? lps[j] : 0.0f, topk_ids ? topk_ids + tk : nullptr,
                              topk_logprobs ? topk_logprobs + tk : nullptr, topk_ids ? topk_k : 0);
    ++num_appended[r];
  }
  if (finished) return;  // later tokens dropped; blocks already freed by the finish
  s.rollback_computed(seq, s.store().seq(seq).num_computed_tokens);  // frees blocks of rejected draft slots
  const int32_t* nd = next_k > 0 ? next_drafts + static_cast<size_t>(r) * next_k : nullptr;
  int32_t n = 0;  // a row's drafts end at its first -1 (rows may have fewer drafts than next_k)
  while (n < next_k && nd[n] >= 0) ++n;
  s.set_draft_tokens(seq, nd, n);
}

}  // namespace

void process_mtp_step(Scheduler& s, const int32_t* num_accepted, const int32_t* output_tokens, int32_t out_cols,
                      const float* logprobs, const int32_t* next_drafts, int32_t next_k, int32_t* num_appended,
                      const int32_t* topk_ids, const float* topk_logprobs, int32_t topk_k) {
  const SchedulerOutputs& out = s.last_outputs();
  s.begin_update();
  int32_t row = 0;
  // Entries are read by index: the fork may add sequences (the slab may move), never entries.
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledSeq e = out.scheduled[i];
    const int32_t r = row;
    row += e.num_samples;
    for (int32_t j = 0; j < e.num_samples; ++j) num_appended[r + j] = 0;
    if (is_finished(s.store().seq(e.seq).status)) continue;  // aborted while the step ran
    if (e.num_samples == 0) {  // mid-prefill chunk
      s.advance_computed(e.seq, e.num_tokens);
      continue;
    }
    // The step computed the last token and num_accepted[r] accepted drafts; rejected drafts' KV
    // is garbage. (Prefill rows have no drafts: every token counts.)
    s.advance_computed(e.seq, e.is_prefill ? e.num_tokens : 1 + num_accepted[r]);
    if (e.num_samples == 1) {
      apply_sample_row(s, e.seq, r, num_accepted, output_tokens, out_cols, logprobs, next_drafts, next_k, num_appended,
                       topk_ids, topk_logprobs, topk_k);
      continue;
    }
    // The chunk completing an n > 1 prompt: the same fork as Scheduler::update, then sample j
    // goes to the parent (j = 0) or child j.
    const std::vector<SeqIndex>& children = s.fork_completed_prompt(e.seq, e.num_samples);
    for (int32_t j = 0; j < e.num_samples; ++j)
      apply_sample_row(s, j == 0 ? e.seq : children[j - 1], r + j, num_accepted, output_tokens, out_cols, logprobs,
                       next_drafts, next_k, num_appended, topk_ids, topk_logprobs, topk_k);
  }
  s.end_update();
}

}  // namespace deepinfer

#include "mtp.h"

namespace deepinfer {

void process_mtp_step(Scheduler& s, const int32_t* num_accepted, const int32_t* output_tokens, int32_t out_cols,
                      const float* logprobs, const int32_t* next_drafts, int32_t next_k, int32_t* num_appended) {
  const SchedulerOutputs& out = s.last_outputs();
  s.begin_update();
  int32_t row = 0;
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    const ScheduledSeq e = out.scheduled[i];
    const bool sampled = e.num_samples > 0;
    const int32_t r = row;
    row += e.num_samples;
    if (sampled) num_appended[r] = 0;
    if (is_finished(s.store().seq(e.seq).status)) continue;  // aborted while the step ran
    if (!sampled) {  // mid-prefill chunk
      s.advance_computed(e.seq, e.num_tokens);
      continue;
    }
    const int32_t acc = num_accepted[r];
    // The step computed the last token and `acc` accepted drafts; rejected drafts' KV is garbage.
    s.advance_computed(e.seq, e.num_tokens - (e.is_prefill ? 0 : (e.num_tokens - 1 - acc)));
    const int32_t* toks = output_tokens + static_cast<size_t>(r) * out_cols;
    const float* lps = logprobs ? logprobs + static_cast<size_t>(r) * out_cols : nullptr;
    bool finished = false;
    for (int32_t j = 0; j <= acc && !finished; ++j) {
      finished = s.append_token(e.seq, toks[j], lps ? lps[j] : 0.0f, nullptr, nullptr, 0);
      ++num_appended[r];
    }
    if (finished) continue;  // later tokens dropped; blocks already freed by the finish
    const int32_t computed = s.store().seq(e.seq).num_computed_tokens;
    s.rollback_computed(e.seq, computed);  // frees blocks of rejected draft slots
    if (next_k > 0) s.set_draft_tokens(e.seq, next_drafts + static_cast<size_t>(r) * next_k, next_k);
    else s.set_draft_tokens(e.seq, nullptr, 0);
  }
  s.end_update();
}

}  // namespace deepinfer

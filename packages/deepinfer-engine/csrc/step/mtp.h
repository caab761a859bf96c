// process_MTPInfo: the update of a speculative-decoding step, built on the Scheduler's update
// primitives (advance_computed / append_token / rollback_computed / set_draft_tokens /
// fork_completed_prompt), so the stop conditions and the n > 1 fork are the Scheduler's own.
#pragma once

#include <cstdint>

#include "core/scheduler.h"

namespace deepinfer {

// Per sample row r of the step (SchedulerOutputs order: each scheduled entry contributes
// num_samples rows; the entry completing an n > 1 prompt contributes n rows, row j = sample j,
// j = 0 the parent, j >= 1 the child forked for it; such rows have no drafts):
// num_accepted[r] accepted drafts, output_tokens[r * out_cols + j] for j <= num_accepted[r]
// (accepted drafts then the bonus token), next_drafts[r * next_k + j] the drafts of the next
// step (next_k may be 0; a row's drafts end at its first -1: rows may have fewer drafts),
// topk_ids / topk_logprobs [r * out_cols * topk_k + j * topk_k + i] the top-k logprobs of each
// appended token (nullptr / 0: none). Appends tokens until a stop; writes appended counts to num_appended.
// The caller validated everything.
void process_mtp_step(Scheduler& s, const int32_t* num_accepted, const int32_t* output_tokens, int32_t out_cols,
                      const float* logprobs, const int32_t* next_drafts, int32_t next_k, int32_t* num_appended,
                      const int32_t* topk_ids = nullptr, const float* topk_logprobs = nullptr, int32_t topk_k = 0);

}  // namespace deepinfer

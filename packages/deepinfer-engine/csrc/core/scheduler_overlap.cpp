// Overlap scheduling (ZOS): step N+1 is scheduled while decode step N is still in flight.
//
// As in SGLang's overlap scheduler and vLLM's async scheduling, the host runs one step ahead of
// the device: each sequence of step N is assumed to get exactly one new token there, so step
// N+1 decodes position L (= the sequence's length before N's token) and needs a slot for it.
// Only the steady state runs ahead (decode after decode, nothing to admit, no preemption, no
// copy-on-write, no multi-token bad word); every other case returns nullptr and the caller goes
// synchronous, so the synchronous scheduler stays the only place with admission and preemption policy.
#include <algorithm>
#include <cstddef>
#include <utility>

#include "core/scheduler.h"

namespace deepinfer {

const SchedulerOutputs* Scheduler::schedule_ahead() {
  const SchedulerOutputs& n = out_;  // step N, in flight
  const int32_t num_n = static_cast<int32_t>(n.scheduled.size());
  // Step N must be plain decodes: one token and one sample each, no device work.
  if (n.num_prefill_tokens != 0 || n.num_decodes != num_n || n.num_decode_tokens != num_n ||
      n.num_sample_rows != num_n || !n.blocks_to_copy.empty() || !n.states_to_clone.empty() ||
      !n.states_to_zero.empty())
    return nullptr;
  if (cfg_.num_lookahead_slots != 0 || !pending_block_copies_.empty() || !pending_state_clones_.empty() ||
      !pending_state_zeros_.empty())
    return nullptr;
  // A request the synchronous scheduler might admit or resume: go synchronous.
  if ((!waiting_.empty() || !preempted_.empty()) && free_seq_units() > 0) return nullptr;

  // Pass 1 (nothing changes): every running sequence is in step N, and the slots fit.
  int32_t unfinished = 0, blocks = 0, rows = 0;
  for (const ScheduledSeq& e : n.scheduled) {
    const Sequence& q = store_.seq(e.seq);
    if (is_finished(q.status)) continue;  // aborted, stopped or finished at the last update
    ++unfinished;
    if (!q.draft_tokens.empty() || q.num_computed_tokens != e.num_computed_before) return nullptr;
    // A multi-token bad word bans by the latest tokens, which step N+1's host inputs lack.
    if (store_.groups[q.group].params.has_multi_token_bad_words()) return nullptr;
    const int32_t L = e.num_computed_before + 1;  // its length before step N's token
    if (q.num_output_tokens() + 1 >= q.max_tokens || L + 1 >= cfg_.max_model_len) continue;  // finishes at N
    const size_t idx = static_cast<size_t>(L / cfg_.block_size);
    if (idx < q.block_table.size() && bm_.ref_count(q.block_table[idx]) > 1) return nullptr;  // copy-on-write
    blocks += bm_.blocks_needed(q.block_table, L, L + 1);
    ++rows;
  }
  if (unfinished != static_cast<int32_t>(running_.size()) || rows == 0 || blocks > bm_.num_free_blocks())
    return nullptr;

  // The housekeeping of a new step, as schedule() but for what happened since the last update
  // (aborts, stop strings while step N runs): those stay reported until the next update's outputs.
  // Groups still named by step N or whose final output is not built are released later.
  release_finished_groups();
  finished_.erase(finished_.begin(), finished_.begin() + static_cast<std::ptrdiff_t>(
                                                              std::min(finished_reported_, finished_.size())));
  finished_reported_ = 0;
  for (SeqIndex s : deferred_finished_) report_finished(s);
  deferred_finished_.clear();

  std::swap(out_, behind_);  // behind_ = step N (its update comes next), out_ = step N+1
  clear_step(out_);
  out_.preempted_seq_ids.clear();
  out_.ignored_seq_ids.clear();
  out_.step = behind_.step + 1;
  step_now_ = now();
  for (const ScheduledSeq& e : behind_.scheduled) {
    Sequence& q = store_.seq(e.seq);
    if (is_finished(q.status)) continue;
    const int32_t L = e.num_computed_before + 1;
    if (q.num_output_tokens() + 1 >= q.max_tokens || L + 1 >= cfg_.max_model_len) continue;
    bool replaced = false;
    bm_.ensure_slots(q.block_table, L, L + 1, out_.blocks_to_copy, &replaced);  // fits: counted above
    if (replaced) touch_block_table(q);
    out_.scheduled.push_back({e.seq, 1, L, 1, false});
    if (q.wants_logprobs) out_.max_logprobs = std::max(out_.max_logprobs, store_.groups[q.group].params.logprobs);
  }
  out_.num_decodes = out_.num_decode_tokens = out_.num_batched_tokens = out_.num_sample_rows = rows;
  ahead_ = overlapped_ = true;
  return &out_;
}

}  // namespace deepinfer

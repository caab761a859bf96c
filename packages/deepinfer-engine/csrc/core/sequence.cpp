#include "core/sequence.h"

#include <atomic>

namespace deepinfer {

namespace {
// Process-wide: versions of different sequences, schedulers and pools never collide (a PrepareArgs
// row may see sequences of several); atomic because builders and schedulers of different
// threads may run with the GIL released.
std::atomic<uint64_t> g_block_table_version{0};
}  // namespace

void touch_block_table(Sequence& s) {
  s.block_table_version = g_block_table_version.fetch_add(1, std::memory_order_relaxed) + 1;
}

const char* finish_reason_str(SequenceStatus s) {
  switch (s) {
    case SequenceStatus::FINISHED_STOPPED: return "stop";
    case SequenceStatus::FINISHED_LENGTH: return "length";
    case SequenceStatus::FINISHED_ABORTED: return "abort";
    case SequenceStatus::FINISHED_IGNORED: return "ignored";
    case SequenceStatus::FINISHED_ERROR: return "error";
    default: return nullptr;
  }
}

SeqIndex SequenceStore::new_seq() {
  SeqIndex i;
  if (!free_seqs.empty()) {
    i = free_seqs.back();
    free_seqs.pop_back();
  } else {
    i = static_cast<SeqIndex>(seqs.size());
    seqs.emplace_back();
  }
  Sequence& s = seqs[i];
  // Clear but keep vector capacities: no allocation when slots are recycled.
  s.seq_id = next_seq_id++;
  s.group = 0;
  s.sample_index = 0;
  s.status = SequenceStatus::WAITING;
  s.ignore_eos = s.has_stop_token_ids = s.wants_logprobs = false;
  s.eos_token_id = -1;
  s.max_tokens = s.min_tokens = 0;
  s.updated_epoch = 0;
  s.tokens.clear();
  s.num_prompt_tokens = s.num_computed_tokens = s.num_cached_tokens = 0;
  s.block_table.clear();
  touch_block_table(s);  // a recycled slot: its table is new (seq_id may repeat across pools)
  s.state_slot = -1;
  s.draft_tokens.clear();
  s.stop_token = -1;
  s.stop_string.clear();
  s.stop_is_string = false;
  s.cumulative_logprob = 0.0;
  s.logprob_token_ids.clear();
  s.logprob_values.clear();
  s.block_hashes.clear();
  s.num_registered_blocks = 0;
  s.num_returned_tokens = 0;
  s.final_output_sent = false;
  return i;
}

GroupIndex SequenceStore::new_group() {
  GroupIndex g;
  if (!free_groups.empty()) {
    g = free_groups.back();
    free_groups.pop_back();
  } else {
    g = static_cast<GroupIndex>(groups.size());
    groups.emplace_back();
  }
  SequenceGroup& gr = groups[g];
  gr.request_id.clear();
  gr.params = SamplingParams{};
  gr.seqs.clear();
  gr.forked = false;
  gr.alive = true;
  gr.arrival_time = 0.0;
  gr.arrival_order = 0;
  gr.eos_token_id = -1;
  gr.cache_salt = 0;
  gr.prompt_logprob_token_ids.clear();
  gr.prompt_logprob_values.clear();
  gr.num_prompt_logprobs = 0;
  gr.num_prompt_positions_returned = 0;
  gr.first_scheduled_time = gr.first_token_time = gr.finished_time = 0.0;
  gr.final_output_sent = false;
  gr.num_unfinished = 0;
  gr.prompt_shared.reset();
  gr.updated_epoch = 0;
  return g;
}

void SequenceStore::release_group(GroupIndex g) {
  SequenceGroup& gr = groups[g];
  for (SeqIndex s : gr.seqs) {
    seqs[s].seq_id = -1;
    free_seqs.push_back(s);
  }
  gr.seqs.clear();
  gr.alive = false;
  free_groups.push_back(g);
}

}  // namespace deepinfer

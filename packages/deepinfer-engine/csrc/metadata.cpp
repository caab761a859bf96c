#include "metadata.h"

#include <stdexcept>
#include <string>

#include "scheduler.h"

namespace deepinfer {

void SequenceMetadataPool::clear() {
  rows_.clear();
  source_ = nullptr;
  num_own_ = 0;
  ++generation_;
}

std::pair<Sequence*, SequenceGroup*> SequenceMetadataPool::add_standalone_row() {
  if (num_own_ == own_seqs_.size()) {
    own_seqs_.emplace_back();
    own_groups_.emplace_back();
  }
  Sequence* s = &own_seqs_[num_own_];
  SequenceGroup* g = &own_groups_[num_own_];
  // Reset but keep vector capacities.
  auto keep = [](auto& v) { v.clear(); };
  keep(s->tokens);
  keep(s->block_table);
  keep(s->draft_tokens);
  s->seq_id = -1;
  s->num_prompt_tokens = s->num_computed_tokens = 0;
  s->state_slot = -1;
  s->status = SequenceStatus::RUNNING;
  g->request_id.clear();
  g->params = SamplingParams{};
  g->prompt_logprob_token_ids.clear();
  g->prompt_logprob_values.clear();
  g->num_prompt_logprobs = 0;
  g->eos_token_id = -1;
  MetadataRow r;
  r.store = nullptr;
  r.index = static_cast<SeqIndex>(num_own_);
  r.seq = s;
  r.group = g;
  rows_.push_back(r);
  ++num_own_;
  ++generation_;
  return {s, g};
}

void SequenceMetadataPool::resolve() {
  // A pool kept from an earlier step would rebuild that step (old positions, stale sampling
  // offsets) and the update would accept it: refuse it whatever the builder.
  if (source_ && (!source_->step_in_flight() || source_->step() != source_step_))
    throw std::invalid_argument(
        "metadata: the SequenceMetadataPool was built for step " + std::to_string(source_step_) +
        " but its scheduler " +
        (source_->step_in_flight() ? "is at step " + std::to_string(source_->step())
                                   : std::string("has no step in flight")) +
        ": call SequenceMetadataPool.build(scheduler) after every schedule(), before the builders");
  // Rows of one step all come from one store (build) or the pool itself (add_sequence).
  const SequenceStore* store = nullptr;
  for (const MetadataRow& r : rows_)
    if (r.store) {
      store = r.store;
      break;
    }
  const void* seqs = store ? static_cast<const void*>(store->seqs.data()) : nullptr;
  const void* groups = store ? static_cast<const void*>(store->groups.data()) : nullptr;
  const size_t nseqs = store ? store->seqs.size() : 0, ngroups = store ? store->groups.size() : 0;
  if (resolved_generation_ == generation_ && seqs == resolved_seqs_ && groups == resolved_groups_ &&
      nseqs == resolved_nseqs_ && ngroups == resolved_ngroups_)
    return;
  for (size_t i = 0; i < rows_.size(); ++i) {
    MetadataRow& r = rows_[i];
    if (r.store == nullptr) {
      r.seq = &own_seqs_[r.index];
      r.group = &own_groups_[r.index];
      continue;
    }
    if (r.index >= r.store->seqs.size())
      throw std::invalid_argument("metadata[" + std::to_string(i) + "]: sequence slot no longer exists");
    r.seq = &r.store->seqs[r.index];
    if (r.seq->group >= r.store->groups.size() || !r.store->groups[r.seq->group].alive)
      throw std::invalid_argument("metadata[" + std::to_string(i) + "]: sequence's request no longer exists");
    r.group = &r.store->groups[r.seq->group];
    if (r.store != store) throw std::invalid_argument("metadata: rows from two different schedulers");
  }
  resolved_generation_ = generation_;
  resolved_seqs_ = seqs;
  resolved_groups_ = groups;
  resolved_nseqs_ = nseqs;
  resolved_ngroups_ = ngroups;
}

}  // namespace deepinfer

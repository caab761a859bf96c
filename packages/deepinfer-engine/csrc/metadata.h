// Per-step view of the scheduled sequences (SequenceMetadata) and the pool that holds them.
//
// A row names a sequence by (store, slot index) and is resolved to pointers at the start of
// every builder call, so adding requests between building the pool and preparing inputs can
// never leave a dangling pointer. Rows added from Python (add_sequence) live in the pool's own
// standalone store. Storage is reused across steps: no allocation in the steady state.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "busy_flag.h"
#include "sequence.h"

namespace deepinfer {

class Scheduler;

struct MetadataRow {
  const SequenceStore* store = nullptr;  // nullptr: the pool's standalone entries
  SeqIndex index = kNoSeq;
  // Step description (copied at build time: the scheduler may advance the sequence after).
  int32_t start = 0;       // first position computed this step (tokens already in KV)
  int32_t num_new = 0;     // query length this step (prefill chunk, or 1 + drafts)
  int32_t num_drafts = 0;  // trailing draft tokens among num_new (speculative decode)
  bool is_prompt = false;  // prefill chunk
  bool do_sample = false;  // samples at the end of this step (last prompt chunk or decode)
  int32_t num_samples = 0; // sample rows (n for the chunk completing an n > 1 prompt, else 0/1)
  // Resolved by SequenceMetadataPool::resolve().
  const Sequence* seq = nullptr;
  const SequenceGroup* group = nullptr;

  int32_t context_len() const { return start + num_new; }
  // Token id at position p of this step (known tokens, then this step's drafts).
  int32_t token_at(int32_t p) const {
    const int32_t L = seq->num_tokens();
    return p < L ? seq->tokens[p] : seq->draft_tokens[p - L];
  }
};

class SequenceMetadataPool {
 public:
  size_t size() const { return rows_.size(); }
  const MetadataRow& operator[](size_t i) const { return rows_[i]; }
  MetadataRow& operator[](size_t i) { return rows_[i]; }
  const std::vector<MetadataRow>& rows() const { return rows_; }

  // Forgets the rows (storage kept).
  void clear();
  // Replaces the rows with the scheduled sequences of one step (ScheduledSeq-like entries:
  // seq, num_tokens, num_computed_before, num_samples, is_prefill), filled by index.
  template <class Entries>
  void build_from(const SequenceStore* store, const Entries& scheduled) {
    clear();
    rows_.resize(scheduled.size());
    for (size_t i = 0; i < scheduled.size(); ++i) {
      const auto& e = scheduled[i];
      MetadataRow& r = rows_[i];
      r.store = store;
      r.index = e.seq;
      r.start = e.num_computed_before;
      r.num_new = e.num_tokens;
      r.num_drafts = e.is_prefill ? 0 : e.num_tokens - 1;
      r.is_prompt = e.is_prefill;
      r.do_sample = e.num_samples > 0;
      r.num_samples = e.num_samples;
      r.seq = nullptr;
      r.group = nullptr;
    }
  }
  // A standalone row: a sequence and request owned by the pool until the next clear().
  // Returns the sequence and group to fill in.
  std::pair<Sequence*, SequenceGroup*> add_standalone_row();
  // Records the scheduler step the rows were built from (SequenceMetadataPool.build): resolve()
  // refuses the rows once that scheduler is at another step or has no step in flight.
  const Scheduler* source() const { return source_; }
  void set_source_step(const Scheduler* scheduler, uint64_t step) {
    source_ = scheduler;
    source_step_ = step;
  }
  // Points every row at its sequence; throws std::invalid_argument when a row no longer names a
  // live sequence of its store, or the rows were built for another step of their scheduler.
  void resolve();
  mutable BusyFlag busy;  // taken by build / add_sequence / clear and the builders (busy_flag.h)
  // Generation: bumped by every change, so PrepareArgs knows which pool its layout came from.
  uint64_t generation() const { return generation_; }

 private:
  std::vector<MetadataRow> rows_;
  const Scheduler* source_ = nullptr;  // built from this scheduler's step source_step_ (null: not built)
  uint64_t source_step_ = 0;
  // What the last resolve() saw: pointers stay valid while the pool is unchanged and no store
  // slab was reallocated, so a second builder call of the same step skips the walk.
  uint64_t resolved_generation_ = 0;
  const void *resolved_seqs_ = nullptr, *resolved_groups_ = nullptr;
  size_t resolved_nseqs_ = 0, resolved_ngroups_ = 0;
  std::deque<Sequence> own_seqs_;  // deque: stable addresses; reused after clear()
  std::deque<SequenceGroup> own_groups_;
  size_t num_own_ = 0;
  uint64_t generation_ = 1;
};

}  // namespace deepinfer

// Continuous-batching scheduler over the shared SequenceStore and the BlockManager.
//
// One step (see ENGINE_API.md):
//   const SchedulerOutputs& out = sched.schedule();
//   ... build inputs from out.scheduled, run the model, sample one token per sample row ...
//   sched.update(tokens, ...);         // or, for speculative steps, step/mtp.h's process_mtp_step,
//                                      // built from begin_update/advance_computed/append_token/end_update
// Sample rows: every ScheduledSeq with num_samples > 0 contributes num_samples rows, in the
// order of out.scheduled (num_samples = n for the step that completes an n > 1 group's prompt:
// the sampler draws n tokens from that sequence's logits; the children are forked by
// fork_completed_prompt, called from update and process_MTPInfo).
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/block_manager.h"
#include "core/busy_flag.h"
#include "core/sequence.h"

namespace deepinfer {

enum class SchedulingPolicy : uint8_t { FCFS = 0, PRIORITY = 1 };

struct SchedulerConfig {
  int32_t block_size = 16;
  int32_t num_blocks = 0;
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_model_len = 8192;
  int32_t vocab_size = 0;
  int32_t eos_token_id = -1;              // default EOS of requests (-1: none)
  bool enable_chunked_prefill = true;
  int32_t long_prefill_token_threshold = 0;  // per-sequence prefill tokens per step (0: no cap)
  SchedulingPolicy policy = SchedulingPolicy::FCFS;
  bool enable_prefix_caching = true;
  double watermark = 0.01;                // fraction of blocks kept free when admitting
  int32_t num_lookahead_slots = 0;        // extra slots reserved per decode (speculative)
  int32_t num_state_slots = 0;            // recurrent-state slots (0: model has none)
  int32_t hash_bits = 64;                 // test hook: < 64 forces prefix-hash collisions

  // Throws InvalidArgument naming the first bad field (including a num_blocks whose host
  // bookkeeping would not fit in memory); returns *this.
  const SchedulerConfig& validated() const;
};

// One scheduled sequence of a step.
struct ScheduledSeq {
  SeqIndex seq = kNoSeq;
  int32_t num_tokens = 0;           // tokens computed this step (prefill chunk, or 1 + drafts)
  int32_t num_computed_before = 0;  // the sequence's num_computed_tokens when scheduled
  int32_t num_samples = 0;          // sample rows this step (0: mid-prefill chunk)
  bool is_prefill = false;          // false: a decode of the last token (+ its drafts)
};

// What one step runs. Owned by the Scheduler and rewritten by every schedule() (no
// allocation in the steady state). Decodes come first, then prefill chunks.
struct SchedulerOutputs {
  const SequenceStore* store = nullptr;  // the scheduler's (to resolve entries)
  uint64_t step = 0;
  std::vector<ScheduledSeq> scheduled;
  int32_t num_decodes = 0;  // scheduled[0, num_decodes) are decodes
  int32_t num_batched_tokens = 0;
  int32_t num_prefill_tokens = 0;
  int32_t num_decode_tokens = 0;
  int32_t num_sample_rows = 0;
  int32_t max_logprobs = -1;  // largest `logprobs` asked by a sampling sequence (-1: none)
  std::vector<int64_t> preempted_seq_ids;
  std::vector<int64_t> ignored_seq_ids;
  // Device work to do before this step's forward: KV block copies (src, dst),
  // state-slot clones (src, dst) and state slots to zero.
  std::vector<BlockCopy> blocks_to_copy;
  std::vector<BlockCopy> states_to_clone;
  std::vector<int32_t> states_to_zero;
  void clear();
};

// One sequence that finished during the current update window (get_finished_seqs_info).
struct FinishedSeq {
  SeqIndex seq;
  int64_t seq_id;
};

struct SchedulerStats {
  int32_t num_running = 0, num_waiting = 0, num_preempted = 0;
  int64_t num_preemptions_total = 0;
  double kv_usage = 0.0;
  double prefix_hit_rate = 0.0;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig& cfg);

  const SchedulerConfig& config() const { return cfg_; }
  SequenceStore& store() { return store_; }
  const SequenceStore& store() const { return store_; }
  BlockManager& block_manager() { return bm_; }
  const SchedulerOutputs& last_outputs() const { return out_; }
  uint64_t step() const { return out_.step; }
  bool step_in_flight() const { return in_flight_; }
  // Overlap (ZOS): a step was scheduled ahead (schedule_ahead) and the step before it still awaits
  // its update: two steps in flight, last_outputs() is the newer one.
  bool step_ahead() const { return ahead_; }
  // The step that the next update() applies: the older one while a step runs ahead.
  const SchedulerOutputs& update_target() const { return ahead_ ? behind_ : out_; }
  // Whether the outputs of the last update may be built: no update pending, or only that of a
  // step scheduled ahead (whose predecessor was updated).
  bool outputs_ready() const { return !in_flight_ || (overlapped_ && !ahead_); }

  // ---- requests ----
  // Throws InvalidArgument naming what is wrong with a request (its id reserved or in use, an
  // empty or too long prompt, a token outside the vocabulary, its sampling parameters, n above
  // max_num_seqs, a non-finite arrival_time, an eos_token_id outside [-1, vocab_size)).
  void check_request(const std::string& request_id, const int32_t* prompt, size_t prompt_len,
                     const SamplingParams& params, double arrival_time, int32_t eos_token_id) const;
  // Checks the request (check_request; nothing changes when it throws), then queues it.
  // Returns the group; prompt tokens are copied. cache_salt: the seed of its prefix-cache
  // hashes (BlockManager::salt_seed of its salt; 0: unsalted): it shares cached KV only with its salt.
  GroupIndex add_request(const std::string& request_id, const int32_t* prompt, size_t prompt_len,
                         const SamplingParams& params, double arrival_time, int32_t eos_token_id,
                         uint64_t cache_salt = 0);
  bool has_request(const std::string& request_id) const { return by_request_.count(request_id) != 0; }
  GroupIndex group_index(const std::string& request_id) const { return by_request_.at(request_id); }
  // Whether add_request must refuse the id: a request has it and its final output was not built
  // yet. Once build_request_outputs returned the final output the id may be reused at once;
  // until then (or until the next schedule()) it still names the finished request.
  bool request_id_in_use(const std::string& request_id) const;
  // Aborts every unfinished sequence of the request; false if it had already finished.
  bool abort_request(const std::string& request_id);
  SeqIndex find_seq(int64_t seq_id) const;  // kNoSeq if unknown or released

  // ---- one step ----
  const SchedulerOutputs& schedule();

  // Overlap (ZOS, scheduler_overlap.cpp): schedules step N+1 while step N is in flight, before
  // step N's tokens are known, assuming each of its sequences gets one new token. Only a
  // decode-only step may run ahead of a decode-only step: nullptr (nothing changed) when step N
  // is not plain decodes (prefill, drafts, n > 1 samples, device work), when a request waits or
  // a preempted one would resume, when a sequence needs a copy-on-write or the blocks for its
  // next slot are not free (preemption), or when every sequence surely finishes at N. The caller
  // then updates step N and schedules synchronously. Sequences that surely finish at N
  // (max_tokens, max_model_len) are left out. The next update() applies step N (update_target());
  // a sequence that finishes there keeps its step N+1 row, which update() then skips.
  // Requires step_in_flight() and !step_ahead() (the binding raises otherwise).
  // Kept out of line: inlined into the binding next to schedule(), it changed that hot code.
  [[gnu::noinline]] const SchedulerOutputs* schedule_ahead();

  // The update after the model ran. update() = begin_update + for each scheduled sequence
  // (advance_computed, then append_token per sample row) + end_update.
  void begin_update();
  // Marks `n` more tokens of the sequence computed and registers newly full blocks in the prefix
  // cache (only blocks whose tokens are present: drafts are not tokens until appended).
  void advance_computed(SeqIndex s, int32_t n);
  // Appends one generated token and applies the stop conditions (EOS unless ignore_eos and
  // not before min_tokens, stop_token_ids, max_tokens, max_model_len). On a stop the sequence
  // is finished: blocks and state slot freed, reported by finished(). Returns true if it
  // finished. topk (when the group asks for logprobs = k) has k (id, logprob) pairs.
  bool append_token(SeqIndex s, int32_t token, float logprob, const int32_t* topk_ids,
                    const float* topk_logprobs, int32_t k);
  // Speculative rollback: sets num_computed_tokens back to `num_computed` and frees the blocks
  // beyond the slots it still needs (num_tokens + lookahead).
  void rollback_computed(SeqIndex s, int32_t num_computed);
  void set_draft_tokens(SeqIndex s, const int32_t* drafts, int32_t k);
  void end_update();

  // Python-facing update: tokens[r] for sample row r (checked by the binding).
  void update(const int32_t* tokens, const float* logprobs, const int32_t* topk_ids,
              const float* topk_logprobs, int32_t k);

  // Recovery from a failed step: abandons the step in flight (after schedule(), before
  // update()/process_MTPInfo) and ends it. The abandoned sequences are the step's scheduled
  // sequences still unfinished plus the owners of its queued device work (the blocks and state
  // slots that blocks_to_copy / states_to_clone / states_to_zero write), whose data the step may
  // have left half-made. fail == false: each of them goes back to the preempted queue for
  // recompute (blocks and state slot freed, tokens kept; blocks the step was to write were never
  // registered in the prefix cache). fail == true: every request with a scheduled sequence is
  // finished (all its sequences) as FINISHED_ERROR and reported like any finish of an update;
  // other owners of device work are recomputed. The step's device work is dropped (every target
  // was reset). `groups` gets the failed groups (fail) or those of the recomputed sequences, each
  // once. No step in flight: does nothing.
  void abandon_step(bool fail, std::vector<GroupIndex>& groups);

  // Finishes a sequence for a stop string found by the detokenizer, keeping the first
  // num_output_tokens output tokens. Reported like any other finish of this update.
  void stop_sequence(SeqIndex s, const std::string& stop_string, int32_t num_output_tokens);

  // Fork support (n > 1): num_children new sequences sharing the parent's full blocks, a copy
  // of its partial last block (shared + copy-on-write when no block is free), a clone of its
  // state slot (or a zeroed one if the parent has no computed state). Appends the device work
  // to the given lists and the children to `children`.
  // units_reserved: the group's n was already counted against max_num_seqs (the fork after an
  // n > 1 prompt); otherwise the children take new units (the caller checked there are enough).
  void fork(SeqIndex parent, int32_t num_children, bool units_reserved, std::vector<SeqIndex>& children,
            std::vector<BlockCopy>& block_copies, std::vector<BlockCopy>& state_clones,
            std::vector<int32_t>& state_zeros);

  // The fork after the step that completed an n > 1 group's prompt (entry e with
  // e.num_samples = n > 1): forks the parent into n - 1 children for sample rows 1..n-1 (row 0
  // stays the parent), turning the group's n reserved max_num_seqs units into theirs; their
  // device work (copy of the partial last block, state clones / zeros) is queued for the next
  // schedule()'s blocks_to_copy / states_to_clone / states_to_zero. Call it after
  // advance_computed(e.seq, e.num_tokens) and before appending the step's tokens (each sample
  // then gets its own). Used by update() and process_MTPInfo. Returns the children in sample
  // order; the reference is valid until the next call.
  const std::vector<SeqIndex>& fork_completed_prompt(SeqIndex parent, int32_t num_samples);

  // Sequences finished since the last schedule() (updates, aborts, stop strings).
  const std::vector<FinishedSeq>& finished() const { return finished_; }
  // Sequences with new output (tokens or a finish) since the last schedule() or drain, each once
  // (build_request_outputs groups them by request).
  std::span<const SeqIndex> updated_seqs() const { return {updated_seqs_.data(), num_updated_}; }
  uint64_t update_epoch() const { return update_epoch_; }
  void drain_updated_seqs() {
    num_updated_ = 0;
    ++update_epoch_;
  }
  // Takes a sequence out of updated_seqs() (its output was corrected in place after a stop string).
  void unmark_updated(SeqIndex s);
  // Free max_num_seqs units / state slots (fork from Python checks them).
  int32_t free_seq_units() const { return cfg_.max_num_seqs - seq_units_; }
  int32_t num_free_state_slots() const { return static_cast<int32_t>(free_state_slots_.size()); }

  bool reset_prefix_cache();
  SchedulerStats stats() const;
  int32_t num_unfinished() const { return num_unfinished_; }
  const std::vector<SeqIndex>& running() const { return running_; }
  const std::deque<SeqIndex>& waiting() const { return waiting_; }
  const std::deque<SeqIndex>& preempted() const { return preempted_; }
  double now() const;
  // Test hook: checks every block/slot invariant; "" when consistent.
  std::string check_invariants() const;

 private:
  bool before(SeqIndex a, SeqIndex b) const;  // scheduling precedence
  template <class Q>
  void insert_sorted(Q& q, SeqIndex s);
  void remove_from_running(SeqIndex s);
  void remove_from_queues(SeqIndex s);  // from running_/waiting_/preempted_ per its status
  [[gnu::cold]] void preempt(SeqIndex s);
  // What a preemption does to the sequence (blocks and slot freed, back to the preempted queue).
  [[gnu::cold]] void reset_for_recompute(SeqIndex s);
  // Frees the sequence's blocks and state slot and cancels the queued device work that wrote them.
  void release_blocks_and_slot(Sequence& q);
  // deferred: the finish happened while no step was in flight and is reported with the next
  // step (abort between update and schedule), so no report is lost.
  [[gnu::cold]] void finish(SeqIndex s, SequenceStatus status, bool deferred);  // off the step loops
  // Once per appended token, so inline with a plain store: the LTO inliner kept
  // std::vector::push_back out of line once the module had more call sites of it (a call per
  // sequence in update()); updated_seqs_ only grows, num_updated_ is its used length.
  void mark_updated(SeqIndex s) {
    Sequence& q = store_.seq(s);
    if (q.updated_epoch == update_epoch_) return;
    q.updated_epoch = update_epoch_;
    if (num_updated_ == updated_seqs_.size()) grow_updated_seqs();
    updated_seqs_[num_updated_++] = s;
  }
  [[gnu::cold, gnu::noinline]] void grow_updated_seqs();
  void prefetch_seq(SeqIndex far, SeqIndex near) const;
  void report_finished(SeqIndex s);
  void release_finished_groups();
  // Whether the group has a sequence in a step in flight (its release must wait for the update).
  bool group_in_flight(GroupIndex g) const;
  void clear_step(SchedulerOutputs& o);  // an abandoned step: no entries, no device work
  void forget_request_id(GroupIndex g);  // unless the id was reused since
  int32_t seq_cost(SeqIndex s) const;  // max_num_seqs units held by a running sequence

  SchedulerConfig cfg_;
  SequenceStore store_;
  BlockManager bm_;
  SchedulerOutputs out_;
  bool in_flight_ = false;
  std::vector<SeqIndex> running_;
  std::deque<SeqIndex> waiting_;
  std::deque<SeqIndex> preempted_;
  std::unordered_map<std::string, GroupIndex> by_request_;
  std::unordered_map<int64_t, SeqIndex> by_seq_id_;
  std::vector<int32_t> free_state_slots_;
  std::vector<FinishedSeq> finished_;
  std::vector<SeqIndex> updated_seqs_;  // the first num_updated_ entries are updated_seqs()
  size_t num_updated_ = 0;
  uint64_t update_epoch_ = 1;
  std::vector<GroupIndex> groups_to_release_;
  std::vector<SeqIndex> deferred_finished_;
  std::vector<ScheduledSeq> prefill_scratch_;
  std::vector<BlockCopy> pending_block_copies_, pending_state_clones_;
  std::vector<int32_t> pending_state_zeros_;
  std::vector<SeqIndex> fork_scratch_;
  std::vector<int32_t> hit_scratch_;
  int32_t seq_units_ = 0;  // max_num_seqs units held by running sequences
  int32_t finished_in_update_ = 0;  // finishes since the last end_update (compaction needed)
  int32_t num_unfinished_ = 0;  // unfinished requests
  uint64_t arrival_counter_ = 0;
  int64_t preemptions_total_ = 0;
  double step_now_ = 0.0;
  // Overlap state, after the members of the synchronous step loops so that their layout (cache
  // lines, short displacements) stays as without it.
  bool ahead_ = false;       // overlap: out_ runs ahead of behind_, whose update is pending
  bool overlapped_ = false;  // out_ was scheduled ahead of its predecessor
  size_t finished_reported_ = 0;  // finished_ entries up to the last end_update
  SchedulerOutputs behind_;  // overlap: the older step in flight while ahead_

 public:
  // Taken by every mutating Python entry point (busy_flag.h). Last: the hot members keep their offsets.
  mutable BusyFlag busy;
};

}  // namespace deepinfer

#include "core/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace deepinfer {

void SchedulerOutputs::clear() {
  scheduled.clear();
  num_decodes = num_batched_tokens = num_prefill_tokens = num_decode_tokens = num_sample_rows = 0;
  max_logprobs = -1;
  preempted_seq_ids.clear();
  ignored_seq_ids.clear();
  blocks_to_copy.clear();
  states_to_clone.clear();
  states_to_zero.clear();
}

namespace {
int32_t watermark_blocks_of(const SchedulerConfig& c) {
  return static_cast<int32_t>(c.watermark * c.num_blocks);
}
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& cfg)
    : cfg_(cfg.validated()),
      bm_(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, watermark_blocks_of(cfg), cfg.hash_bits) {
  out_.store = &store_;
  behind_.store = &store_;
  for (int32_t i = cfg.num_state_slots - 1; i >= 0; --i) free_state_slots_.push_back(i);
  running_.reserve(static_cast<size_t>(cfg.max_num_seqs) + 1);
  out_.scheduled.reserve(static_cast<size_t>(cfg.max_num_seqs) + 1);
  prefill_scratch_.reserve(static_cast<size_t>(cfg.max_num_seqs) + 1);
}

double Scheduler::now() const {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

bool Scheduler::before(SeqIndex a, SeqIndex b) const {
  const Sequence& x = store_.seq(a);
  const Sequence& y = store_.seq(b);
  const SequenceGroup& gx = store_.groups[x.group];
  const SequenceGroup& gy = store_.groups[y.group];
  if (cfg_.policy == SchedulingPolicy::PRIORITY && gx.params.priority != gy.params.priority)
    return gx.params.priority < gy.params.priority;
  if (gx.arrival_time != gy.arrival_time) return gx.arrival_time < gy.arrival_time;
  if (gx.arrival_order != gy.arrival_order) return gx.arrival_order < gy.arrival_order;
  return x.seq_id < y.seq_id;
}

template <class Q>
void Scheduler::insert_sorted(Q& q, SeqIndex s) {
  // Scan from the back: new arrivals usually go last.
  auto it = q.end();
  while (it != q.begin() && before(s, *(it - 1))) --it;
  q.insert(it, s);
}

void Scheduler::remove_from_running(SeqIndex s) {
  auto it = std::find(running_.begin(), running_.end(), s);
  if (it != running_.end()) running_.erase(it);
}

void Scheduler::remove_from_queues(SeqIndex s) {
  switch (store_.seq(s).status) {
    case SequenceStatus::RUNNING: remove_from_running(s); break;
    case SequenceStatus::PREEMPTED: preempted_.erase(std::find(preempted_.begin(), preempted_.end(), s)); break;
    case SequenceStatus::WAITING: waiting_.erase(std::find(waiting_.begin(), waiting_.end(), s)); break;
    default: break;
  }
}

int32_t Scheduler::seq_cost(SeqIndex s) const {
  const Sequence& q = store_.seq(s);
  const SequenceGroup& g = store_.groups[q.group];
  return (!g.forked && g.params.n > 1 && q.sample_index == 0) ? g.params.n : 1;
}

GroupIndex Scheduler::add_request(const std::string& request_id, const int32_t* prompt, size_t prompt_size,
                                  const SamplingParams& params, double arrival_time, int32_t eos_token_id,
                                  uint64_t cache_salt) {
  check_request(request_id, prompt, prompt_size, params, arrival_time, eos_token_id);
  const int32_t prompt_len = static_cast<int32_t>(prompt_size);
  const GroupIndex g = store_.new_group();
  const SeqIndex s = store_.new_seq();
  SequenceGroup& gr = store_.groups[g];
  gr.request_id = request_id;
  gr.params = params;
  gr.arrival_time = arrival_time;
  gr.arrival_order = arrival_counter_++;
  gr.eos_token_id = eos_token_id;
  gr.cache_salt = cache_salt;
  gr.seqs.push_back(s);
  gr.num_unfinished = 1;
  Sequence& q = store_.seq(s);
  q.group = g;
  // Reserve the longest possible sequence: appends never reallocate.
  const int64_t cap = std::min<int64_t>(static_cast<int64_t>(prompt_len) + params.max_tokens,
                                        std::max<int64_t>(cfg_.max_model_len, prompt_len) + 1);
  q.tokens.reserve(static_cast<size_t>(cap));
  q.tokens.assign(prompt, prompt + prompt_len);
  q.num_prompt_tokens = prompt_len;
  q.ignore_eos = params.ignore_eos;
  q.has_stop_token_ids = !params.stop_token_ids.empty();
  q.wants_logprobs = params.logprobs >= 0;
  q.eos_token_id = eos_token_id;
  q.max_tokens = params.max_tokens;
  q.min_tokens = params.min_tokens;
  q.block_hashes.reserve(static_cast<size_t>(cap / cfg_.block_size + 1));
  by_request_[request_id] = g;  // may take over the id of a finished request (request_id_in_use)
  by_seq_id_.emplace(q.seq_id, s);
  insert_sorted(waiting_, s);
  ++num_unfinished_;
  return g;
}

bool Scheduler::request_id_in_use(const std::string& request_id) const {
  auto it = by_request_.find(request_id);
  if (it == by_request_.end()) return false;
  const SequenceGroup& g = store_.groups[it->second];
  return !(g.num_unfinished == 0 && g.final_output_sent);
}

void Scheduler::forget_request_id(GroupIndex g) {
  auto it = by_request_.find(store_.groups[g].request_id);
  if (it != by_request_.end() && it->second == g) by_request_.erase(it);  // not a reuse of the id
}

SeqIndex Scheduler::find_seq(int64_t seq_id) const {
  auto it = by_seq_id_.find(seq_id);
  return it == by_seq_id_.end() ? kNoSeq : it->second;
}

bool Scheduler::abort_request(const std::string& request_id) {
  const GroupIndex g = by_request_.at(request_id);
  bool any = false;
  // Copy: finish() does not change the group's list, but keep the loop independent of it.
  for (size_t i = 0; i < store_.groups[g].seqs.size(); ++i) {
    const SeqIndex s = store_.groups[g].seqs[i];
    Sequence& q = store_.seq(s);
    if (is_finished(q.status)) continue;
    remove_from_queues(s);
    finish(s, SequenceStatus::FINISHED_ABORTED, !in_flight_);
    any = true;
  }
  return any;
}

void Scheduler::unmark_updated(SeqIndex s) {
  Sequence& q = store_.seq(s);
  if (q.updated_epoch != update_epoch_) return;
  const auto end = updated_seqs_.begin() + static_cast<std::ptrdiff_t>(num_updated_);
  const auto it = std::find(updated_seqs_.begin(), end, s);
  std::copy(it + 1, end, it);
  --num_updated_;
  q.updated_epoch = 0;
}

void Scheduler::grow_updated_seqs() { updated_seqs_.resize(std::max<size_t>(64, 2 * updated_seqs_.size())); }

void Scheduler::report_finished(SeqIndex s) {
  Sequence& q = store_.seq(s);
  finished_.push_back({s, q.seq_id});
  mark_updated(s);
  SequenceGroup& g = store_.groups[q.group];
  if (g.num_unfinished == 0) groups_to_release_.push_back(q.group);
}

void Scheduler::finish(SeqIndex s, SequenceStatus status, bool deferred) {
  Sequence& q = store_.seq(s);
  ++finished_in_update_;
  if (q.status == SequenceStatus::RUNNING) seq_units_ -= seq_cost(s);
  q.status = status;
  release_blocks_and_slot(q);
  q.draft_tokens.clear();
  SequenceGroup& g = store_.groups[q.group];
  if (--g.num_unfinished == 0) {
    g.finished_time = now();
    --num_unfinished_;
  }
  if (deferred) deferred_finished_.push_back(s);
  else report_finished(s);
}

void Scheduler::release_blocks_and_slot(Sequence& q) {
  bm_.free_table(q.block_table);
  touch_block_table(q);
  // Device work queued by a fork for the next step must not write what nobody holds any more:
  // the block may be handed to another sequence (a copy into it would overwrite that one's KV,
  // and a second copy could name it as a destination again), the slot zeroed for a new owner.
  if (!pending_block_copies_.empty())
    pending_block_copies_.erase(std::remove_if(pending_block_copies_.begin(), pending_block_copies_.end(),
                                               [this](const BlockCopy& c) { return bm_.ref_count(c[1]) == 0; }),
                                pending_block_copies_.end());
  if (q.state_slot >= 0) {
    const int32_t slot = q.state_slot;
    pending_state_clones_.erase(std::remove_if(pending_state_clones_.begin(), pending_state_clones_.end(),
                                               [slot](const BlockCopy& c) { return c[1] == slot; }),
                                pending_state_clones_.end());
    pending_state_zeros_.erase(std::remove(pending_state_zeros_.begin(), pending_state_zeros_.end(), slot),
                               pending_state_zeros_.end());
    free_state_slots_.push_back(slot);
    q.state_slot = -1;
  }
}

void Scheduler::preempt(SeqIndex s) {
  reset_for_recompute(s);
  out_.preempted_seq_ids.push_back(store_.seq(s).seq_id);
  ++preemptions_total_;
}

void Scheduler::reset_for_recompute(SeqIndex s) {
  Sequence& q = store_.seq(s);
  seq_units_ -= seq_cost(s);
  remove_from_running(s);
  release_blocks_and_slot(q);
  q.num_computed_tokens = 0;
  q.num_registered_blocks = 0;
  q.draft_tokens.clear();
  q.status = SequenceStatus::PREEMPTED;
  insert_sorted(preempted_, s);
}

void Scheduler::abandon_step(bool fail, std::vector<GroupIndex>& groups) {
  groups.clear();
  if (!in_flight_) return;
  std::vector<SeqIndex> step_seqs;
  for (const ScheduledSeq& e : out_.scheduled)
    if (!is_finished(store_.seq(e.seq).status)) step_seqs.push_back(e.seq);
  // Overlap: the older step in flight too (schedule_ahead admits only steps without device work).
  if (ahead_)
    for (const ScheduledSeq& e : behind_.scheduled)
      if (!is_finished(store_.seq(e.seq).status)) step_seqs.push_back(e.seq);
  // Owners of the step's device work: each destination block / slot belongs to one running
  // sequence (a fresh block or slot from a fork, a copy-on-write or an admission).
  std::vector<SeqIndex> owners;
  if (!out_.blocks_to_copy.empty() || !out_.states_to_clone.empty() || !out_.states_to_zero.empty()) {
    std::vector<uint8_t> block_dst(static_cast<size_t>(cfg_.num_blocks), 0);
    std::vector<uint8_t> slot_dst(static_cast<size_t>(cfg_.num_state_slots), 0);
    for (const BlockCopy& c : out_.blocks_to_copy) block_dst[c[1]] = 1;
    for (const BlockCopy& c : out_.states_to_clone) slot_dst[c[1]] = 1;
    for (int32_t z : out_.states_to_zero) slot_dst[z] = 1;
    for (SeqIndex s : running_) {
      const Sequence& q = store_.seq(s);
      bool hit = q.state_slot >= 0 && slot_dst[q.state_slot];
      for (size_t i = 0; !hit && i < q.block_table.size(); ++i) hit = block_dst[q.block_table[i]] != 0;
      if (hit) owners.push_back(s);
    }
  }
  auto add_group = [&groups](GroupIndex g) {
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  };
  if (fail) {
    for (SeqIndex s : step_seqs) add_group(store_.seq(s).group);
    for (GroupIndex g : groups)
      for (size_t i = 0; i < store_.groups[g].seqs.size(); ++i) {
        const SeqIndex s = store_.groups[g].seqs[i];
        if (is_finished(store_.seq(s).status)) continue;
        remove_from_queues(s);
        finish(s, SequenceStatus::FINISHED_ERROR, false);
      }
  }
  step_seqs.insert(step_seqs.end(), owners.begin(), owners.end());
  for (SeqIndex s : step_seqs) {
    if (store_.seq(s).status != SequenceStatus::RUNNING) continue;  // failed above, or listed twice
    if (!fail) add_group(store_.seq(s).group);
    reset_for_recompute(s);
  }
  clear_step(out_);
  clear_step(behind_);
  finished_in_update_ = 0;
  in_flight_ = ahead_ = overlapped_ = false;
}

void Scheduler::clear_step(SchedulerOutputs& o) {
  o.scheduled.clear();
  o.num_decodes = o.num_batched_tokens = o.num_prefill_tokens = o.num_decode_tokens = 0;
  o.num_sample_rows = 0;
  o.max_logprobs = -1;
  o.blocks_to_copy.clear();
  o.states_to_clone.clear();
  o.states_to_zero.clear();
}

bool Scheduler::group_in_flight(GroupIndex g) const {
  for (const ScheduledSeq& e : out_.scheduled)
    if (store_.seq(e.seq).group == g) return true;
  if (ahead_)
    for (const ScheduledSeq& e : behind_.scheduled)
      if (store_.seq(e.seq).group == g) return true;
  return false;
}

void Scheduler::release_finished_groups() {
  size_t kept = 0;
  for (GroupIndex g : groups_to_release_) {
    SequenceGroup& gr = store_.groups[g];
    if (!gr.alive) continue;
    // Overlap: a step in flight still names its sequences (update skips them), or the request's
    // final output is still to be built (an abort while a step was in flight): release later.
    if (in_flight_ && (!gr.final_output_sent || group_in_flight(g))) {
      groups_to_release_[kept++] = g;
      continue;
    }
    forget_request_id(g);
    for (SeqIndex s : gr.seqs) by_seq_id_.erase(store_.seq(s).seq_id);
    store_.release_group(g);
  }
  groups_to_release_.resize(kept);
}

const SchedulerOutputs& Scheduler::schedule() {
  if (in_flight_) throw std::logic_error("schedule() called again before update() of step " + std::to_string(out_.step));
  release_finished_groups();
  finished_.clear();
  finished_reported_ = 0;
  drain_updated_seqs();
  for (SeqIndex s : deferred_finished_) report_finished(s);
  deferred_finished_.clear();

  const uint64_t step = out_.step + 1;
  out_.clear();
  out_.step = step;
  step_now_ = now();
  // Device work queued by forks since the last step runs before this step's forward.
  out_.blocks_to_copy.swap(pending_block_copies_);
  out_.states_to_clone.swap(pending_state_clones_);
  out_.states_to_zero.swap(pending_state_zeros_);
  pending_block_copies_.clear();
  pending_state_clones_.clear();
  pending_state_zeros_.clear();

  const int32_t bs = cfg_.block_size;
  int32_t budget = cfg_.max_num_batched_tokens;
  prefill_scratch_.clear();
  bool preempted_any = false;

  // 1. Running sequences, most important first; victims are taken from the back.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    const size_t nr = running_.size();
    prefetch_seq(i + 8 < nr ? running_[i + 8] : kNoSeq, i + 4 < nr ? running_[i + 4] : kNoSeq);
    if (i + 2 < nr) {  // the ref count that the copy-on-write check of that sequence reads
      const Sequence& f = store_.seqs[running_[i + 2]];
      const size_t idx = static_cast<size_t>(f.num_computed_tokens / cfg_.block_size);
      if (idx < f.block_table.size()) bm_.prefetch_block(f.block_table[idx]);
    }
    const SeqIndex s = running_[i];
    Sequence& q = store_.seq(s);
    const bool prefill = q.is_prefill();
    int32_t n;
    if (!prefill) {
      // The last token plus its drafts, within the step budget and the model length (no
      // position may reach max_model_len); drafts that do not fit are dropped.
      n = 1 + static_cast<int32_t>(q.draft_tokens.size());
      const int32_t fit = std::min(budget, cfg_.max_model_len - q.num_computed_tokens);
      if (n > fit) {
        n = std::max(fit, 1);
        q.draft_tokens.resize(static_cast<size_t>(n - 1));
      }
    } else {
      q.draft_tokens.clear();
      n = q.num_tokens() - q.num_computed_tokens;
      if (cfg_.long_prefill_token_threshold > 0) n = std::min(n, cfg_.long_prefill_token_threshold);
      n = std::min(n, budget);
    }
    const int32_t slots = q.num_computed_tokens + n + (prefill ? 0 : cfg_.num_lookahead_slots);
    bool self_preempted = false;
    bool replaced = false;  // copy-on-write of its partial last block
    while (!bm_.ensure_slots(store_.seq(s).block_table, store_.seq(s).num_computed_tokens, slots,
                             out_.blocks_to_copy, &replaced)) {
      const SeqIndex victim = running_.back();
      preempt(victim);
      preempted_any = true;
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    Sequence& r = store_.seq(s);
    if (replaced) touch_block_table(r);
    const bool completes = r.num_computed_tokens + n >= r.num_tokens();
    ScheduledSeq e{s, n, r.num_computed_tokens, completes ? (prefill ? seq_cost(s) : 1) : 0, prefill};
    if (prefill && completes && r.num_output_tokens() > 0) e.num_samples = 1;
    if (e.num_samples > 0 && r.wants_logprobs)
      out_.max_logprobs = std::max(out_.max_logprobs, store_.groups[r.group].params.logprobs);
    if (prefill) {
      prefill_scratch_.push_back(e);
      out_.num_prefill_tokens += n;
    } else {
      out_.scheduled.push_back(e);
      out_.num_decode_tokens += n;
    }
    budget -= n;
    ++i;
  }

  // 2. Admissions in precedence order, none in a step that preempted: the preempted and the waiting
  // queues are each sorted; their fronts compete by priority (policy 'priority'), a preempted
  // sequence winning ties (then arrival time and add order, within each queue).
  while (!preempted_any && budget > 0) {
    bool from_preempted = !preempted_.empty();
    if (!from_preempted && waiting_.empty()) break;
    if (from_preempted && !waiting_.empty() && cfg_.policy == SchedulingPolicy::PRIORITY &&
        store_.group_of(waiting_.front()).params.priority < store_.group_of(preempted_.front()).params.priority)
      from_preempted = false;
    const SeqIndex s = from_preempted ? preempted_.front() : waiting_.front();
    Sequence& q = store_.seq(s);
    if (!from_preempted && q.num_prompt_tokens > cfg_.max_model_len) {
      waiting_.pop_front();
      q.stop_string = "prompt has " + std::to_string(q.num_prompt_tokens) + " tokens, more than max_model_len " +
                      std::to_string(cfg_.max_model_len);
      q.stop_is_string = true;
      out_.ignored_seq_ids.push_back(q.seq_id);
      finish(s, SequenceStatus::FINISHED_IGNORED, false);
      continue;
    }
    const int32_t cost = seq_cost(s);
    if (seq_units_ + cost > cfg_.max_num_seqs) break;
    if (cfg_.num_state_slots > 0 && static_cast<int32_t>(free_state_slots_.size()) < 1) break;
    int32_t hits = 0;
    if (bm_.prefix_caching()) {
      // Never the last token; and a request asking for prompt logprobs computes every position
      // whose logprobs it does not hold yet (its blocks are still registered for the others).
      int32_t max_hits = (q.num_tokens() - 1) / bs;
      const SequenceGroup& qg = store_.groups[q.group];
      if (qg.params.prompt_logprobs >= 0) max_hits = std::min(max_hits, qg.num_prompt_logprobs / bs);
      bm_.extend_hashes(q.block_hashes, q.tokens.data(), q.num_tokens(), qg.cache_salt);
      hits = bm_.match_prefix(q.block_hashes, q.tokens.data(), max_hits, hit_scratch_, qg.cache_salt);
    }
    const int32_t computed = hits * bs;
    int32_t n = q.num_tokens() - computed;
    if (cfg_.enable_chunked_prefill) {
      if (cfg_.long_prefill_token_threshold > 0) n = std::min(n, cfg_.long_prefill_token_threshold);
      n = std::min(n, budget);
    } else if (n > budget) {
      break;
    }
    const int32_t new_blocks = bm_.blocks_for(computed + n) - hits;
    const int32_t taken = new_blocks + bm_.num_free_among(hit_scratch_.data(), hits);
    if (bm_.num_free_blocks() - taken < bm_.watermark_blocks()) break;
    // Admit.
    if (from_preempted) preempted_.pop_front();
    else waiting_.pop_front();
    if (bm_.prefix_caching()) bm_.record_lookup(q.num_tokens(), computed);
    bm_.acquire(hit_scratch_.data(), hits, q.block_table);
    bm_.ensure_slots(q.block_table, computed, computed + n, out_.blocks_to_copy);
    touch_block_table(q);  // a new table (prefix hits, maybe a copy-on-write of the last hit)
    q.num_computed_tokens = computed;
    q.num_cached_tokens = computed;
    q.num_registered_blocks = hits;
    q.status = SequenceStatus::RUNNING;
    if (cfg_.num_state_slots > 0) {
      q.state_slot = free_state_slots_.back();
      free_state_slots_.pop_back();
      out_.states_to_zero.push_back(q.state_slot);
    }
    seq_units_ += cost;
    SequenceGroup& g = store_.groups[q.group];
    if (g.first_scheduled_time == 0.0) g.first_scheduled_time = step_now_;
    const bool completes = computed + n >= q.num_tokens();
    ScheduledSeq e{s, n, computed, completes ? (q.num_output_tokens() > 0 ? 1 : cost) : 0, true};
    if (e.num_samples > 0 && q.wants_logprobs)
      out_.max_logprobs = std::max(out_.max_logprobs, store_.groups[q.group].params.logprobs);
    prefill_scratch_.push_back(e);
    out_.num_prefill_tokens += n;
    budget -= n;
    insert_sorted(running_, s);
  }

  out_.num_decodes = static_cast<int32_t>(out_.scheduled.size());
  out_.scheduled.insert(out_.scheduled.end(), prefill_scratch_.begin(), prefill_scratch_.end());
  out_.num_batched_tokens = out_.num_prefill_tokens + out_.num_decode_tokens;
  int32_t rows = 0;
  for (const ScheduledSeq& e : out_.scheduled) rows += e.num_samples;
  out_.num_sample_rows = rows;
  in_flight_ = true;
  overlapped_ = false;
  return out_;
}

// Software prefetch for the batch loops (B up to thousands of sequences, each on its own cache
// lines): the sequence `far` ahead, and the token tail / block-table tail of the one `near` ahead
// (whose struct should be cached by now).
void Scheduler::prefetch_seq(SeqIndex far, SeqIndex near) const {
  if (far != kNoSeq) {
    const char* p = reinterpret_cast<const char*>(&store_.seqs[far]);
    __builtin_prefetch(p);
    __builtin_prefetch(p + 64);
  }
  if (near != kNoSeq) {
    const Sequence& q = store_.seqs[near];
    if (!q.tokens.empty()) __builtin_prefetch(q.tokens.data() + q.tokens.size(), 1);
    if (!q.block_table.empty()) __builtin_prefetch(q.block_table.data() + q.block_table.size() - 1);
  }
}

void Scheduler::begin_update() {
  if (!in_flight_) throw std::logic_error("update() without a scheduled step (call schedule() first)");
  step_now_ = now();
}

void Scheduler::advance_computed(SeqIndex s, int32_t n) {
  Sequence& q = store_.seq(s);
  q.num_computed_tokens += n;
  if (is_finished(q.status) || !bm_.prefix_caching()) return;
  const int32_t full = std::min(q.num_computed_tokens, q.num_tokens()) / cfg_.block_size;
  if (full > q.num_registered_blocks) {
    const uint64_t salt = store_.groups[q.group].cache_salt;
    bm_.extend_hashes(q.block_hashes, q.tokens.data(), full * cfg_.block_size, salt);
    q.num_registered_blocks =
        bm_.register_blocks(q.block_table, q.block_hashes, q.tokens.data(), q.num_registered_blocks, full, salt);
  }
}

bool Scheduler::append_token(SeqIndex s, int32_t token, float logprob, const int32_t* topk_ids,
                             const float* topk_logprobs, int32_t k) {
  Sequence& q = store_.seq(s);
  q.tokens.push_back(token);
  q.cumulative_logprob += logprob;
  if (q.wants_logprobs) {
    const int32_t want = store_.groups[q.group].params.logprobs;
    q.logprob_token_ids.push_back(token);
    q.logprob_values.push_back(logprob);
    for (int32_t j = 0; j < want; ++j) {
      const bool have = topk_ids != nullptr && j < k;
      q.logprob_token_ids.push_back(have ? topk_ids[j] : -1);
      q.logprob_values.push_back(have ? topk_logprobs[j] : 0.0f);
    }
  }
  const int32_t out_len = q.num_output_tokens();
  if (out_len == 1) {  // the group is touched once per sample, not every step
    SequenceGroup& g = store_.groups[q.group];
    if (g.first_token_time == 0.0) g.first_token_time = step_now_;
  }
  mark_updated(s);
  SequenceStatus st = SequenceStatus::RUNNING;
  if (out_len >= q.min_tokens) {
    if (!q.ignore_eos && q.eos_token_id >= 0 && token == q.eos_token_id) {
      st = SequenceStatus::FINISHED_STOPPED;
    } else if (q.has_stop_token_ids && store_.groups[q.group].params.is_stop_token(token)) {
      st = SequenceStatus::FINISHED_STOPPED;
      q.stop_token = token;
    }
  }
  if (st == SequenceStatus::RUNNING && (out_len >= q.max_tokens || q.num_tokens() >= cfg_.max_model_len))
    st = SequenceStatus::FINISHED_LENGTH;
  if (st == SequenceStatus::RUNNING) return false;
  finish(s, st, false);
  return true;
}

void Scheduler::rollback_computed(SeqIndex s, int32_t num_computed) {
  Sequence& q = store_.seq(s);
  q.num_computed_tokens = num_computed;
  if (q.num_registered_blocks > num_computed / cfg_.block_size)
    q.num_registered_blocks = num_computed / cfg_.block_size;  // those blocks stay cached (same tokens)
  if (!is_finished(q.status) && bm_.trim(q.block_table, q.num_tokens() + cfg_.num_lookahead_slots))
    touch_block_table(q);  // the table shrank
}

void Scheduler::set_draft_tokens(SeqIndex s, const int32_t* drafts, int32_t k) {
  Sequence& q = store_.seq(s);
  q.draft_tokens.assign(drafts, drafts + k);
}

void Scheduler::end_update() {
  if (finished_in_update_ > 0)  // compaction only when something finished (saves a pass over B)
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [this](SeqIndex s) { return is_finished(store_.seq(s).status); }),
                   running_.end());
  finished_in_update_ = 0;
  finished_reported_ = finished_.size();
  if (ahead_) ahead_ = false;  // the step scheduled ahead stays in flight
  else in_flight_ = false;
}

void Scheduler::update(const int32_t* tokens, const float* logprobs, const int32_t* topk_ids,
                       const float* topk_logprobs, int32_t k) {
  begin_update();
  int32_t row = 0;
  // fork() may add sequences (the slab may move), never entries: the entry array stays put.
  const std::vector<ScheduledSeq>& target = update_target().scheduled;  // the older step when one runs ahead
  const ScheduledSeq* const entries = target.data();
  const size_t num = target.size();
  for (size_t i = 0; i < num; ++i) {
    prefetch_seq(i + 8 < num ? entries[i + 8].seq : kNoSeq, i + 4 < num ? entries[i + 4].seq : kNoSeq);
    const ScheduledSeq e = entries[i];
    if (is_finished(store_.seq(e.seq).status)) {  // aborted while the step ran
      row += e.num_samples;
      continue;
    }
    advance_computed(e.seq, e.num_tokens);
    if (e.num_samples == 0) continue;
    const std::vector<SeqIndex>* children = e.num_samples > 1 ? &fork_completed_prompt(e.seq, e.num_samples) : nullptr;
    auto lp = [&](int32_t r) { return logprobs ? logprobs[r] : 0.0f; };
    auto ids = [&](int32_t r) { return topk_ids ? topk_ids + static_cast<size_t>(r) * k : nullptr; };
    auto vals = [&](int32_t r) { return topk_logprobs ? topk_logprobs + static_cast<size_t>(r) * k : nullptr; };
    append_token(e.seq, tokens[row], lp(row), ids(row), vals(row), k);
    for (int32_t j = 1; j < e.num_samples; ++j) {
      const int32_t r = row + j;
      append_token((*children)[j - 1], tokens[r], lp(r), ids(r), vals(r), k);
    }
    row += e.num_samples;
  }
  end_update();
}

const std::vector<SeqIndex>& Scheduler::fork_completed_prompt(SeqIndex parent, int32_t num_samples) {
  fork_scratch_.clear();
  fork(parent, num_samples - 1, true, fork_scratch_, pending_block_copies_, pending_state_clones_,
       pending_state_zeros_);
  return fork_scratch_;
}

void Scheduler::stop_sequence(SeqIndex s, const std::string& stop_string, int32_t num_output_tokens) {
  Sequence& q = store_.seq(s);
  const int32_t keep = q.num_prompt_tokens + num_output_tokens;
  if (keep < q.num_tokens()) {
    q.tokens.resize(static_cast<size_t>(keep));
    if (store_.group_of(s).params.logprobs >= 0) {
      const size_t per = static_cast<size_t>(store_.group_of(s).params.logprobs) + 1;
      q.logprob_token_ids.resize(per * num_output_tokens);
      q.logprob_values.resize(per * num_output_tokens);
    }
    if (q.num_returned_tokens > num_output_tokens) q.num_returned_tokens = num_output_tokens;
    if (q.num_computed_tokens > keep) q.num_computed_tokens = keep;
  }
  q.stop_token = -1;
  q.stop_string = stop_string;
  q.stop_is_string = true;
  if (is_finished(q.status)) {  // e.g. also hit max_tokens in this update: the stop string wins
    q.status = SequenceStatus::FINISHED_STOPPED;
    q.final_output_sent = false;  // build_request_outputs reports the corrected finish
    store_.group_of(s).final_output_sent = false;
    mark_updated(s);
    return;
  }
  remove_from_queues(s);
  finish(s, SequenceStatus::FINISHED_STOPPED, false);
}

void Scheduler::fork(SeqIndex parent, int32_t num_children, bool units_reserved, std::vector<SeqIndex>& children,
                     std::vector<BlockCopy>& block_copies, std::vector<BlockCopy>& state_clones,
                     std::vector<int32_t>& state_zeros) {
  const GroupIndex g = store_.seq(parent).group;
  const bool parent_running = store_.seq(parent).status == SequenceStatus::RUNNING;
  const int32_t cost_before = parent_running ? seq_cost(parent) : 0;
  store_.groups[g].forked = true;  // from now on every sequence of the group costs one unit
  // The fork after an n > 1 prompt turns the parent's n reserved units into the children's;
  // any other fork releases what the parent held beyond its one unit.
  if (!units_reserved && parent_running) seq_units_ += seq_cost(parent) - cost_before;
  for (int32_t j = 0; j < num_children; ++j) {
    const SeqIndex c = store_.new_seq();  // may move the slab: index, never hold references
    const Sequence& p = store_.seq(parent);
    Sequence& ch = store_.seq(c);
    SequenceGroup& gr = store_.groups[g];
    ch.group = g;
    ch.sample_index = static_cast<int32_t>(gr.seqs.size());
    ch.status = p.status;
    ch.ignore_eos = p.ignore_eos;
    ch.has_stop_token_ids = p.has_stop_token_ids;
    ch.wants_logprobs = p.wants_logprobs;
    ch.eos_token_id = p.eos_token_id;
    ch.max_tokens = p.max_tokens;
    ch.min_tokens = p.min_tokens;
    ch.tokens.reserve(p.tokens.capacity());
    ch.tokens.assign(p.tokens.begin(), p.tokens.end());
    ch.num_prompt_tokens = p.num_prompt_tokens;
    ch.num_computed_tokens = p.num_computed_tokens;
    ch.num_cached_tokens = p.num_cached_tokens;
    ch.cumulative_logprob = p.cumulative_logprob;
    ch.logprob_token_ids = p.logprob_token_ids;
    ch.logprob_values = p.logprob_values;
    ch.block_hashes.reserve(p.block_hashes.capacity());
    ch.block_hashes.assign(p.block_hashes.begin(), p.block_hashes.end());
    ch.num_registered_blocks = std::min<int32_t>(p.num_registered_blocks, p.num_computed_tokens / cfg_.block_size);
    // num_returned_tokens stays 0: the child's first delta output carries the inherited tokens too.
    bm_.fork_table(p.block_table, p.num_computed_tokens, ch.block_table, block_copies);
    touch_block_table(ch);
    if (p.state_slot >= 0 && !free_state_slots_.empty()) {
      ch.state_slot = free_state_slots_.back();
      free_state_slots_.pop_back();
      if (p.num_computed_tokens > 0) state_clones.push_back({p.state_slot, ch.state_slot});
      else state_zeros.push_back(ch.state_slot);
    }
    gr.seqs.push_back(c);
    ++gr.num_unfinished;
    by_seq_id_.emplace(ch.seq_id, c);
    if (!units_reserved && ch.status == SequenceStatus::RUNNING) ++seq_units_;
    if (ch.status == SequenceStatus::RUNNING) insert_sorted(running_, c);
    children.push_back(c);
  }
}

bool Scheduler::reset_prefix_cache() {
  bm_.reset_prefix_cache();
  // Running sequences keep num_registered_blocks: their blocks computed before the reset must
  // never be registered again (the next block's parent is no longer cached, so the chain stays
  // broken until the table is freed).
  return true;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats st;
  st.num_running = static_cast<int32_t>(running_.size());
  st.num_waiting = static_cast<int32_t>(waiting_.size());
  st.num_preempted = static_cast<int32_t>(preempted_.size());
  st.num_preemptions_total = preemptions_total_;
  const BlockManagerStats b = bm_.stats();
  st.kv_usage = b.num_blocks ? 1.0 - static_cast<double>(b.num_free_blocks) / b.num_blocks : 0.0;
  st.prefix_hit_rate = b.prefix_queries ? static_cast<double>(b.prefix_hits) / b.prefix_queries : 0.0;
  return st;
}

std::string Scheduler::check_invariants() const {
  std::vector<const std::vector<int32_t>*> tables;
  int32_t units = 0;
  std::vector<int32_t> slot_owner(static_cast<size_t>(cfg_.num_state_slots), 0);
  for (const SequenceGroup& g : store_.groups) {
    if (!g.alive) continue;
    for (SeqIndex s : g.seqs) {
      const Sequence& q = store_.seq(s);
      tables.push_back(&q.block_table);
      const std::string id = "sequence " + std::to_string(q.seq_id);
      if (q.status != SequenceStatus::RUNNING) {
        if (!q.block_table.empty()) return id + " holds blocks while not running";
        if (q.state_slot >= 0) return id + " holds a state slot while not running";
        continue;
      }
      units += seq_cost(s);
      if (!in_flight_ && q.num_computed_tokens >= q.num_tokens())
        return id + " is running with every token computed (nothing left to schedule)";
      if (bm_.blocks_for(q.num_computed_tokens) > static_cast<int32_t>(q.block_table.size()))
        return id + " has fewer slots than computed tokens";
      if (cfg_.num_state_slots > 0) {
        if (q.state_slot < 0) return id + " is running without a state slot";
        if (slot_owner[q.state_slot]++) return "state slot " + std::to_string(q.state_slot) + " owned twice";
      }
    }
  }
  if (units != seq_units_) return "max_num_seqs units " + std::to_string(seq_units_) + " != recomputed " + std::to_string(units);
  if (units > cfg_.max_num_seqs) return "more running sequences than max_num_seqs";
  if (cfg_.num_state_slots > 0) {
    int32_t used = 0;
    for (int32_t o : slot_owner) used += o;
    if (used + static_cast<int32_t>(free_state_slots_.size()) != cfg_.num_state_slots) return "state slots leaked";
  }
  for (const SchedulerOutputs* o : {&out_, &behind_}) {
    if (!in_flight_ || (o == &behind_ && !ahead_)) continue;
    for (const ScheduledSeq& e : o->scheduled) {
      const Sequence& q = store_.seq(e.seq);
      if (q.status == SequenceStatus::RUNNING &&
          bm_.blocks_for(e.num_computed_before + e.num_tokens) > static_cast<int32_t>(q.block_table.size()))
        return "sequence " + std::to_string(q.seq_id) + " lacks slots for its scheduled tokens";
    }
  }
  size_t running = 0;
  for (SeqIndex s : running_) {
    if (store_.seq(s).status != SequenceStatus::RUNNING) return "finished sequence left in the running list";
    ++running;
  }
  return bm_.check_consistency(tables);
}

}  // namespace deepinfer

// The shared sequence store of the engine (the Scheduler owns it; step/ code reads and updates
// sequences only through the Scheduler API in scheduler.h).
//
// Sequences live in a slab (std::vector<Sequence>) addressed by SeqIndex; indices stay valid
// across reallocations, pointers/references do not (never keep a Sequence& across a call that
// may add sequences: add_request, update (forks), clone_and_zero_states_and_blocks).
// A slot is reused only after its group finished and was released at the start of the next
// Scheduler::schedule(); seq_id (monotonic, never reused) is what Python sees.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/sampling_params.h"

namespace deepinfer {

using SeqIndex = uint32_t;    // slot in SequenceStore::seqs
using GroupIndex = uint32_t;  // slot in SequenceStore::groups
constexpr SeqIndex kNoSeq = 0xffffffffu;

// Request id of padding rows (device-graph batch padding, discarded ZOS rows).
constexpr const char* kPlaceholderRequestId = "__deepinfer_placeholder__";

enum class SequenceStatus : uint8_t {
  WAITING = 0,           // queued, never scheduled (or released by reset)
  RUNNING = 1,           // holds blocks, scheduled when budget allows
  PREEMPTED = 2,         // blocks freed by recompute; resumes before new requests of its priority
  FINISHED_STOPPED = 3,  // EOS, a stop token id or a stop string
  FINISHED_LENGTH = 4,   // max_tokens or max model length
  FINISHED_ABORTED = 5,  // abort_request
  FINISHED_IGNORED = 6,  // never scheduled: prompt longer than the model length / the cache
  FINISHED_ERROR = 7,    // its request was failed by Scheduler::abandon_step (a failed step)
};
inline bool is_finished(SequenceStatus s) { return s >= SequenceStatus::FINISHED_STOPPED; }
// "stop" / "length" / "abort" / "ignored" / "error", or nullptr while not finished.
const char* finish_reason_str(SequenceStatus s);

struct Sequence {
  // Hot fields first (read every step): the stop criteria are copied from the group's params
  // so that an update touches only the sequence.
  int64_t seq_id = -1;
  GroupIndex group = 0;
  int32_t sample_index = 0;  // index of this sample in its group (0 = the parent)
  SequenceStatus status = SequenceStatus::WAITING;
  bool ignore_eos = false;
  bool has_stop_token_ids = false;
  bool wants_logprobs = false;
  int32_t eos_token_id = -1;
  int32_t max_tokens = 0;
  int32_t min_tokens = 0;
  uint64_t updated_epoch = 0;  // == the Scheduler's epoch: already in updated_seqs()

  // Tokens: prompt followed by outputs, one contiguous vector (capacity reserved at creation
  // for the longest possible sequence, so appends never reallocate).
  std::vector<int32_t> tokens;
  int32_t num_prompt_tokens = 0;
  int32_t num_computed_tokens = 0;  // tokens whose KV is in the cache (prefix hits included)
  int32_t num_cached_tokens = 0;    // prefix-cache hit tokens at the last admission

  // KV blocks (ids into the BlockManager), covering at least num_computed_tokens slots.
  std::vector<int32_t> block_table;
  // Lets the input builders skip an unchanged block-table row in O(1) (prepare_inputs.cpp).
  // Contract: set by touch_block_table() (one process-wide, monotonically increasing counter:
  // never reused, never 0 once set) whenever an EXISTING entry of block_table changes or the
  // table shrinks, is cleared or replaced (copy-on-write, trim, free, preemption, fork, prefix-hit
  // acquire at admission, slot reuse, a standalone table assigned). Pure appends may keep it.
  // Over-touching only costs speed; a missed touch makes the builders keep a stale row (wrong
  // KV), so every mutation of block_table other than an append must be followed by a touch.
  // 0: unknown (the builders compare contents).
  uint64_t block_table_version = 0;
  int32_t state_slot = -1;  // recurrent-state slot (hybrid models); -1 when none

  // Speculative decoding: drafts to verify in the next decode step (set by process_MTPInfo).
  std::vector<int32_t> draft_tokens;

  // Finish bookkeeping.
  int64_t stop_token = -1;    // token id that stopped it (stop_token_ids), else -1
  std::string stop_string;    // stop string (set by Scheduler::stop_sequence), or the ignore reason
  bool stop_is_string = false;

  // Per output token: cumulative logprob of the sampled tokens, and when the group's params
  // ask for logprobs = k: (1 + k) (token id, logprob) entries per output token, sampled first.
  double cumulative_logprob = 0.0;
  std::vector<int32_t> logprob_token_ids;
  std::vector<float> logprob_values;

  // Prefix caching: chained hashes of this sequence's full blocks (index i covers tokens
  // [i*block_size, (i+1)*block_size)), extended as blocks fill; num_registered_blocks leading
  // blocks of block_table are registered in (or were hits of) the prefix cache.
  std::vector<uint64_t> block_hashes;
  int32_t num_registered_blocks = 0;

  // Outputs: output tokens already returned by build_request_outputs (delta kind).
  int32_t num_returned_tokens = 0;
  bool final_output_sent = false;  // its finished completion was returned once

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  const int32_t* output_tokens() const { return tokens.data() + num_prompt_tokens; }
  int32_t last_token() const { return tokens.back(); }
  // A prompt (or recompute) chunk rather than a decode of the last token. A prompt's last token
  // is a prefill too (it completes the prompt: an n > 1 request samples n rows and forks there).
  bool is_prefill() const {
    return num_computed_tokens < num_tokens() - 1 ||
           (num_tokens() == num_prompt_tokens && num_computed_tokens < num_tokens());
  }
};

// Gives s.block_table a new version (see Sequence::block_table_version). Thread-safe.
void touch_block_table(Sequence& s);

// One request: its sampling parameters, its n samples, its prompt logprobs and metrics.
struct SequenceGroup {
  std::string request_id;
  SamplingParams params;
  std::vector<SeqIndex> seqs;  // seqs[0] is the parent; children appended by the fork
  bool forked = false;         // n > 1: children were created after the prefill
  bool alive = false;          // slot in use
  double arrival_time = 0.0;   // seconds (time.time() clock)
  uint64_t arrival_order = 0;  // add_request order, ties broken by it
  int32_t eos_token_id = -1;   // -1: no EOS for this request
  uint64_t cache_salt = 0;     // seed of its prefix-cache hashes (0: unsalted; BlockManager)

  // Prompt logprobs (params.prompt_logprobs = k >= 0): for prompt positions 1..P-1, (1 + k)
  // (token id, logprob) entries each, the prompt token first; filled chunk by chunk by
  // update_prompt_logprobs (step/prompt_logprobs.h). num_prompt_logprobs = positions filled so far.
  std::vector<int32_t> prompt_logprob_token_ids;
  std::vector<float> prompt_logprob_values;
  int32_t num_prompt_logprobs = 0;
  int32_t num_prompt_positions_returned = 0;  // prompt positions (0 included) already in an output (delta kind)

  // Metrics (time.time() seconds; 0 = not yet).
  double first_scheduled_time = 0.0;
  double first_token_time = 0.0;
  double finished_time = 0.0;
  bool final_output_sent = false;
  std::shared_ptr<const std::vector<int32_t>> prompt_shared;  // made by the first output
  int32_t num_unfinished = 0;    // sequences of the group not finished yet
  uint64_t updated_epoch = 0;    // build_request_outputs: already output in this build
};

// The slab of sequences and groups. Owned by the Scheduler.
struct SequenceStore {
  std::vector<Sequence> seqs;
  std::vector<SequenceGroup> groups;
  std::vector<SeqIndex> free_seqs;
  std::vector<GroupIndex> free_groups;
  int64_t next_seq_id = 0;

  Sequence& seq(SeqIndex i) { return seqs[i]; }
  const Sequence& seq(SeqIndex i) const { return seqs[i]; }
  SequenceGroup& group_of(SeqIndex i) { return groups[seqs[i].group]; }
  const SequenceGroup& group_of(SeqIndex i) const { return groups[seqs[i].group]; }

  SeqIndex new_seq();       // a cleared slot (capacity of its vectors kept)
  GroupIndex new_group();   // a cleared slot
  void release_group(GroupIndex g);  // frees the group slot and its sequences' slots
};

}  // namespace deepinfer

// Sampler inputs of a step, built by prepare_sampler_inputs from a prepared step layout.
//
// Rows are *sample rows*: one per sampled token, in batch-row order (a row completing an n > 1
// prompt contributes n sample rows drawn from the same logits row; a decode-only step adds one
// placeholder sample row per padding batch row, at the end). This is the order the Scheduler's
// update() expects its tokens in. Sparse per-row lists use CSR: offsets (rows + 1) + values.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/busy_flag.h"
#include "step/output_buffer.h"

namespace deepinfer {

struct SamplingKernelInputs {
  OutputBuffer<int32_t> logits_rows;  // logits row (index into the step's logits) of each sample row
  OutputBuffer<float> temperature, top_p, min_p;
  OutputBuffer<int32_t> top_k;        // -1: off
  OutputBuffer<int64_t> seeds;        // per-request RNG seed (the request's seed, else derived)
  OutputBuffer<int64_t> offsets;      // index of the output token being sampled (RNG offset)
  OutputBuffer<int32_t> subsequences; // sample index within the request (n > 1)
  int32_t num_rows = 0;
  bool all_greedy = true, all_random = true, no_top_k = true, no_top_p = true, no_min_p = true;
};

struct LogitsTransformInputs {
  OutputBuffer<float> presence_penalty, frequency_penalty, repetition_penalty;
  // Full mode: per row the distinct tokens of the sequence so far, how often each occurs in its
  // output, and whether it occurs in its prompt (incremental mode: offsets all 0, lists empty).
  OutputBuffer<int32_t> penalty_offsets, penalty_token_ids, penalty_output_counts;
  OutputBuffer<uint8_t> penalty_in_prompt;
  // Incremental mode: per row the consumer-resident table slot holding its sequence's counts
  // (-1: none), and this step's per-slot updates (CSR over num_penalty_updates slots).
  OutputBuffer<int32_t> penalty_slots;
  OutputBuffer<int32_t> penalty_update_slots, penalty_update_offsets, penalty_update_token_ids;
  OutputBuffer<uint8_t> penalty_update_reset, penalty_update_is_output;
  int32_t num_penalty_updates = 0, num_penalty_slots = 0;
  // ZOS: logits row of the previous step whose sampled token is a pending output token of this
  // row (to be counted by the device), -1 when none.
  OutputBuffer<int32_t> penalty_pending_source;
  OutputBuffer<int32_t> bias_offsets, bias_token_ids;
  OutputBuffer<float> bias_values;
  // Tokens masked to -inf: banned_token_ids, the tokens that would complete a bad word
  // (match_bad_words) and, below min_tokens, EOS and the stop token ids.
  OutputBuffer<int32_t> banned_offsets, banned_token_ids;
  // Only these tokens allowed (an empty range: all allowed).
  OutputBuffer<int32_t> allowed_offsets, allowed_token_ids;
  int32_t num_rows = 0;
  bool no_penalties = true, no_logit_bias = true, no_banned = true, no_allowed = true;
};

struct PrefillSamplingInputs {
  OutputBuffer<int32_t> sample_rows;  // sample rows of prefill (prompt-completing) sequences
  int32_t num_rows = 0;
};

struct DecodeSamplingInputs {
  OutputBuffer<int32_t> sample_rows;  // sample rows of decode sequences, then the padding rows
  int32_t num_rows = 0, num_real_rows = 0;
};

struct DriverSamplingInputs {
  OutputBuffer<int64_t> seq_ids;       // -1 for placeholder rows
  OutputBuffer<int32_t> batch_rows;
  OutputBuffer<int32_t> num_logprobs;  // logprobs requested (top-k), -1 none
  int32_t num_rows = 0, num_real_rows = 0, max_num_logprobs = -1;
};

struct SpeculativeSamplingInputs {
  OutputBuffer<int32_t> sample_rows;         // per speculative sequence: its sample row
  OutputBuffer<int32_t> num_drafts;          // per speculative sequence
  OutputBuffer<int32_t> cu_num_drafts;       // num_seqs + 1 offsets into draft_token_ids
  OutputBuffer<int32_t> draft_token_ids;     // flat
  OutputBuffer<int32_t> target_logits_rows;  // flat, per draft: the logits row that verifies it
  OutputBuffer<int32_t> bonus_logits_rows;   // per sequence: logits row of the bonus token
  int32_t num_seqs = 0, num_drafts_total = 0;
};

struct PromptLogprobInputs {
  OutputBuffer<int32_t> logits_rows;       // logits rows whose log-softmax gives a prompt logprob
  OutputBuffer<int32_t> target_token_ids;  // the prompt token at position + 1
  OutputBuffer<int32_t> positions;         // prompt position of the target token (1..P-1)
  OutputBuffer<int32_t> batch_rows;
  OutputBuffer<int64_t> seq_ids;
  OutputBuffer<int32_t> num_logprobs;      // top-k requested per row
  int32_t num_rows = 0, max_num_logprobs = -1;
};

// Distinct tokens of a sequence with output counts / prompt flags, kept between steps so a
// step costs O(new tokens + distinct tokens) per penalized sequence.
struct PenaltyCounts {
  int32_t num_counted = 0;
  int32_t num_prompt = 0;
  uint64_t last_step = 0;
  std::vector<int32_t> token_ids, output_counts;
  std::vector<uint8_t> in_prompt;
  std::unordered_map<int32_t, int32_t> index;
};

// Incremental mode: what the consumer's table of a sequence holds (its slot, the first
// num_sent tokens of the sequence, num_prompt of them counted as prompt).
struct PenaltySlotState {
  int32_t slot = -1;
  int32_t num_sent = 0;
  int32_t num_prompt = 0;
  uint64_t last_step = 0;
};

enum class PenaltyCountsMode : uint8_t { INCREMENTAL, FULL };

struct SamplerInputs {
  // `storage` makes the memory of every output array (the binding: numpy arrays).
  explicit SamplerInputs(const BufferStorageFactory& storage, uint64_t generator_seed_ = 0,
                         PenaltyCountsMode mode = PenaltyCountsMode::INCREMENTAL);
  SamplingKernelInputs kernel;
  LogitsTransformInputs transform;
  PrefillSamplingInputs prefill;
  DecodeSamplingInputs decode;
  DriverSamplingInputs driver;
  SpeculativeSamplingInputs speculative;
  PromptLogprobInputs prompt_logprobs;
  uint64_t generator_seed;
  uint64_t step = 0;
  uint64_t num_calls = 0;  // prepare_sampler_inputs calls that filled this object (rejected ones excluded)
  PenaltyCountsMode penalty_mode;
  std::unordered_map<int64_t, PenaltyCounts> penalty_cache;  // full mode, by seq_id
  std::unordered_map<int64_t, PenaltySlotState> penalty_slot_states;  // incremental mode, by seq_id
  std::vector<int32_t> free_penalty_slots;  // incremental mode: slot ids to reuse (a stack)
  int32_t num_penalty_slots = 0;            // incremental mode: slot ids handed out so far
  mutable BusyFlag busy;  // taken by prepare_sampler_inputs and reset_penalty_tables (busy_flag.h)

  // Forget every slot: the next call sends each penalized sequence whole (reset = 1).
  void reset_penalty_tables() {
    penalty_slot_states.clear();
    free_penalty_slots.clear();
    num_penalty_slots = 0;
    penalty_cache.clear();
  }
};

class PrepareArgs;
class SequenceMetadataPool;

// Output sizes of one prepare_sampler_inputs call (elements per kind of output array).
struct SamplerInputSizes {
  size_t rows = 0, penalty = 0, bias = 0, banned = 0, allowed = 0, spec_seqs = 0, drafts = 0, prompt_lp = 0;
  size_t updates = 0, update_entries = 0;
};

// prepare_sampler_inputs in three passes, for callers that must take a lock to grow the outputs
// (the binding holds the GIL only for reserve_sampler_inputs):
// 1. plan_sampler_inputs validates the step against the last layout of `args` (built from
//    `pool`; InvalidArgument otherwise), counts penalty tokens and plans the penalty-slot
//    updates; it returns the output sizes and changes nothing a caller reads.
// 2. reserve_sampler_inputs grows the outputs that are too small (sampler_inputs_fit: none).
// 3. write_sampler_inputs fills `out`; call it on the same thread, right after 1 (and 2), with
//    the same arguments: it reads what plan_sampler_inputs left in this thread's scratch.
SamplerInputSizes plan_sampler_inputs(SamplerInputs& out, const PrepareArgs& args, SequenceMetadataPool& pool);
bool sampler_inputs_fit(SamplerInputs& out, const SamplerInputSizes& sizes);
void reserve_sampler_inputs(SamplerInputs& out, const SamplerInputSizes& sizes);
void write_sampler_inputs(SamplerInputs& out, const PrepareArgs& args, const SequenceMetadataPool& pool);

// The three passes in order: fills `out` for the step last prepared with `args` from `pool`.
void prepare_sampler_inputs(SamplerInputs& out, const PrepareArgs& args, SequenceMetadataPool& pool);

// The seed of an unseeded request: a fixed function of (generator_seed, seq_id).
uint64_t derived_seed(uint64_t generator_seed, int64_t seq_id);

// vLLM's bad words for one sample row: appends to `dst` the last token of every word of `words`
// whose other tokens equal the most recent output tokens (a one-token word: always). The
// output so far is `known` (n_known tokens) followed by `drafts` (n_drafts tokens: the draft
// tokens a speculative row's sampled token follows). `complete` is false when the latest output
// token is not on the host (a ZOS row, its token of the previous step pending on the device):
// then only one-token words can match. Appends unsorted, possibly repeated ids.
void match_bad_words(const std::vector<std::vector<int32_t>>& words, const int32_t* known, size_t n_known,
                     const int32_t* drafts, size_t n_drafts, bool complete, std::vector<int32_t>& dst);

}  // namespace deepinfer

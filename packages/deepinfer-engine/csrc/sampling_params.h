// Per-request sampling parameters, owned by the request's SequenceGroup.
//
// There is no Python class for them: Scheduler.add_request takes them as keyword arguments
// (the runtime maps its SamplingParams onto those). Sparse lists are kept sorted by token id
// so the sampler-input builders can copy them without sorting.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace deepinfer {

// How build_request_outputs reports a request.
enum class OutputKind : uint8_t {
  CUMULATIVE = 0,  // every output carries all tokens so far
  DELTA = 1,       // only the tokens added since the previous output
  FINAL_ONLY = 2,  // one output, when the request finishes
};

struct SamplingParams {
  int32_t n = 1;                   // samples per prompt (children forked after prefill)
  float temperature = 1.0f;        // 0 = greedy
  float top_p = 1.0f;              // (0, 1]
  int32_t top_k = -1;              // -1 = off
  float min_p = 0.0f;              // [0, 1]
  float presence_penalty = 0.0f;   // [-2, 2]
  float frequency_penalty = 0.0f;  // [-2, 2]
  float repetition_penalty = 1.0f; // > 0, 1 = off
  bool has_seed = false;
  int64_t seed = 0;
  std::vector<int32_t> stop_token_ids;  // sorted, unique
  bool ignore_eos = false;
  int32_t max_tokens = 16;  // >= 1
  int32_t min_tokens = 0;   // 0 <= min_tokens <= max_tokens; EOS/stop ids do not stop before it
  int32_t logprobs = -1;         // -1: none; k >= 0: sampled token's logprob + top-k per output token
  int32_t prompt_logprobs = -1;  // -1: none; k >= 0: per prompt token (after the first)
  std::vector<std::pair<int32_t, float>> logit_bias;  // sorted by token id, unique
  std::vector<int32_t> allowed_token_ids;  // sorted, unique; empty = every token allowed
  std::vector<int32_t> banned_token_ids;   // sorted, unique
  int32_t priority = 0;                    // smaller = more important (priority policy)
  OutputKind output_kind = OutputKind::CUMULATIVE;

  bool is_greedy() const { return temperature == 0.0f; }
  bool has_penalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
  bool is_stop_token(int32_t t) const {
    for (int32_t s : stop_token_ids)
      if (s == t) return true;
    return false;
  }
};

// Bounds that are not fixed by the meaning of a field (the runtime's SamplingParams mirrors
// them; tests/engine/test_sampling_params_bounds.py compares the two).
constexpr float kMaxLogitBias = 100.0f;  // |logit_bias| (OpenAI / vLLM: [-100, 100])
constexpr int32_t kMaxLogprobs = 20;     // logprobs / prompt_logprobs top-k (vLLM's max_logprobs)

// Checks every field; returns "" when valid, else "<field>: <value> <why>" (the binding raises
// ValueError with it). vocab_size bounds every token id in the lists.
std::string validate_sampling_params(const SamplingParams& p, int32_t vocab_size);

}  // namespace deepinfer

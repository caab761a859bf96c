// Per-request sampling parameters, owned by the request's SequenceGroup.
//
// Python sees them as deepinfer._C.engine.SamplingParams (python/bind_sampling_params.cpp),
// which validates with validate() in its constructor and on every assignment:
// Scheduler.add_request and SequenceMetadataPool.add_sequence take that object. The runtime's
// deepinfer.SamplingParams holds one. Sparse lists are kept sorted by token id so the
// sampler-input builders can copy them without sorting. Real-valued fields are doubles, so
// Python reads back the value it set; the sampler inputs carry them as float32.
#pragma once

#include <cstdint>
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
  double temperature = 1.0;        // 0 = greedy
  double top_p = 1.0;              // (0, 1]
  int32_t top_k = -1;              // -1 = off
  double min_p = 0.0;              // [0, 1]
  double presence_penalty = 0.0;   // [-2, 2]
  double frequency_penalty = 0.0;  // [-2, 2]
  double repetition_penalty = 1.0; // > 0, 1 = off
  bool has_seed = false;
  int64_t seed = 0;
  std::vector<int32_t> stop_token_ids;  // sorted, unique
  bool ignore_eos = false;
  int32_t max_tokens = 16;  // >= 1
  int32_t min_tokens = 0;   // 0 <= min_tokens <= max_tokens; EOS/stop ids do not stop before it
  int32_t logprobs = -1;         // -1: none; k >= 0: sampled token's logprob + top-k per output token
  int32_t prompt_logprobs = -1;  // -1: none; k >= 0: per prompt token (after the first)
  std::vector<std::pair<int32_t, double>> logit_bias;  // sorted by token id, unique
  std::vector<int32_t> allowed_token_ids;  // sorted, unique; empty = every token allowed
  std::vector<int32_t> banned_token_ids;   // sorted, unique
  // vLLM's bad words as token sequences (each non-empty): the token that would complete one is
  // masked — a one-token word always, a longer word when the output so far ends with its other
  // tokens (match_bad_words in step/sampler_inputs.h).
  std::vector<std::vector<int32_t>> bad_words_token_ids;
  // Set by Scheduler.add_request (request attributes, not part of the Python SamplingParams):
  int32_t priority = 0;                    // smaller = more important (priority policy)
  OutputKind output_kind = OutputKind::CUMULATIVE;

  bool is_greedy() const { return static_cast<float>(temperature) == 0.0f; }  // as the sampler (float32) sees it
  bool has_penalties() const {
    return presence_penalty != 0.0 || frequency_penalty != 0.0 || repetition_penalty != 1.0;
  }
  // A bad word of more than one token: its ban depends on the tokens before the sampled one.
  bool has_multi_token_bad_words() const {
    for (const auto& w : bad_words_token_ids)
      if (w.size() > 1) return true;
    return false;
  }
  bool is_stop_token(int32_t t) const {
    for (int32_t s : stop_token_ids)
      if (s == t) return true;
    return false;
  }
  bool operator==(const SamplingParams&) const = default;
  // The one place the sampling rules live: throws InvalidArgument naming the first bad field
  // ("temperature: -0.5 must be a finite value >= 0"). vocab_size bounds every token id of the
  // lists and the logprob counts (0: unknown, ids need only be >= 0).
  void validate(int32_t vocab_size) const;
};

// Bounds that are not fixed by the meaning of a field. They live here only: the runtime's
// SamplingParams stores its engine fields in the bound C++ object, which applies them
// (tests/engine/test_sampling_params_bounds.py checks that Python holds no copy).
constexpr double kMaxLogitBias = 100.0;  // |logit_bias| (OpenAI / vLLM: [-100, 100])
constexpr int32_t kMaxLogprobs = 20;     // logprobs / prompt_logprobs top-k (vLLM's max_logprobs)

}  // namespace deepinfer

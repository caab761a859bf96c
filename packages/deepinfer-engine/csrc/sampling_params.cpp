#include <cmath>
#include <string>

#include "sampling_params.h"

namespace deepinfer {

namespace {
std::string num(double v) {
  std::string s = std::to_string(v);
  // trim trailing zeros of std::to_string's fixed format
  if (s.find('.') != std::string::npos) {
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
  }
  return s;
}
std::string check_ids(const char* field, const std::vector<int32_t>& ids, int32_t vocab) {
  for (int32_t t : ids)
    if (t < 0 || t >= vocab)
      return std::string(field) + ": token id " + std::to_string(t) + " is outside the vocabulary [0, " +
             std::to_string(vocab) + ")";
  return "";
}
}  // namespace

std::string validate_sampling_params(const SamplingParams& p, int32_t vocab) {
  if (p.n < 1) return "n: " + std::to_string(p.n) + " must be >= 1";
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    return "temperature: " + num(p.temperature) + " must be a finite value >= 0";
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) return "top_p: " + num(p.top_p) + " must be in (0, 1]";
  if (p.top_k < -1 || p.top_k == 0) return "top_k: " + std::to_string(p.top_k) + " must be -1 (off) or >= 1";
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) return "min_p: " + num(p.min_p) + " must be in [0, 1]";
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    return "presence_penalty: " + num(p.presence_penalty) + " must be in [-2, 2]";
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    return "frequency_penalty: " + num(p.frequency_penalty) + " must be in [-2, 2]";
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
    return "repetition_penalty: " + num(p.repetition_penalty) + " must be a finite value > 0";
  if (p.max_tokens < 1) return "max_tokens: " + std::to_string(p.max_tokens) + " must be >= 1";
  if (p.min_tokens < 0) return "min_tokens: " + std::to_string(p.min_tokens) + " must be >= 0";
  if (p.min_tokens > p.max_tokens)
    return "min_tokens: " + std::to_string(p.min_tokens) + " must be <= max_tokens (" +
           std::to_string(p.max_tokens) + ")";
  if (p.logprobs < -1) return "logprobs: " + std::to_string(p.logprobs) + " must be >= 0 (or None)";
  if (p.prompt_logprobs < -1)
    return "prompt_logprobs: " + std::to_string(p.prompt_logprobs) + " must be >= 0 (or None)";
  if (p.logprobs > kMaxLogprobs)
    return "logprobs: " + std::to_string(p.logprobs) + " must be <= " + std::to_string(kMaxLogprobs);
  if (p.prompt_logprobs > kMaxLogprobs)
    return "prompt_logprobs: " + std::to_string(p.prompt_logprobs) + " must be <= " + std::to_string(kMaxLogprobs);
  for (const auto& [t, b] : p.logit_bias)
    if (!(b >= -kMaxLogitBias && b <= kMaxLogitBias))
      return "logit_bias: bias " + num(b) + " of token " + std::to_string(t) + " must be in [-" +
             num(kMaxLogitBias) + ", " + num(kMaxLogitBias) + "]";
  if (vocab > 0 && p.logprobs > vocab)
    return "logprobs: " + std::to_string(p.logprobs) + " exceeds the vocabulary size " + std::to_string(vocab);
  if (vocab > 0 && p.prompt_logprobs > vocab)
    return "prompt_logprobs: " + std::to_string(p.prompt_logprobs) + " exceeds the vocabulary size " +
           std::to_string(vocab);
  if (vocab > 0) {
    std::string e;
    if (!(e = check_ids("stop_token_ids", p.stop_token_ids, vocab)).empty()) return e;
    if (!(e = check_ids("allowed_token_ids", p.allowed_token_ids, vocab)).empty()) return e;
    if (!(e = check_ids("banned_token_ids", p.banned_token_ids, vocab)).empty()) return e;
    for (const auto& [t, b] : p.logit_bias) {
      if (t < 0 || t >= vocab)
        return "logit_bias: token id " + std::to_string(t) + " is outside the vocabulary [0, " +
               std::to_string(vocab) + ")";
    }
  }
  return "";
}

}  // namespace deepinfer

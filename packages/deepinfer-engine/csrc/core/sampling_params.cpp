#include "core/sampling_params.h"

#include <cmath>
#include <string>

#include "core/invalid_argument.h"

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
// Token ids in [0, vocab) (vocab 0: unknown, only >= 0).
void check_ids(const char* field, const std::vector<int32_t>& ids, int32_t vocab) {
  for (int32_t t : ids)
    if (t < 0 || (vocab > 0 && t >= vocab))
      throw InvalidArgument(field, "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                       std::to_string(vocab) + ")");
}
}  // namespace

void SamplingParams::validate(int32_t vocab) const {
  const SamplingParams& p = *this;
  if (p.n < 1) throw InvalidArgument("n", std::to_string(p.n) + " must be >= 1");
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    throw InvalidArgument("temperature", num(p.temperature) + " must be a finite value >= 0");
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) throw InvalidArgument("top_p", num(p.top_p) + " must be in (0, 1]");
  if (p.top_k < -1 || p.top_k == 0) throw InvalidArgument("top_k", std::to_string(p.top_k) + " must be -1 (off) or >= 1");
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) throw InvalidArgument("min_p", num(p.min_p) + " must be in [0, 1]");
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    throw InvalidArgument("presence_penalty", num(p.presence_penalty) + " must be in [-2, 2]");
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    throw InvalidArgument("frequency_penalty", num(p.frequency_penalty) + " must be in [-2, 2]");
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
    throw InvalidArgument("repetition_penalty", num(p.repetition_penalty) + " must be a finite value > 0");
  if (p.max_tokens < 1) throw InvalidArgument("max_tokens", std::to_string(p.max_tokens) + " must be >= 1");
  if (p.min_tokens < 0) throw InvalidArgument("min_tokens", std::to_string(p.min_tokens) + " must be >= 0");
  if (p.min_tokens > p.max_tokens)
    throw InvalidArgument("min_tokens",
                          std::to_string(p.min_tokens) + " must be <= max_tokens (" + std::to_string(p.max_tokens) + ")");
  if (p.logprobs < -1) throw InvalidArgument("logprobs", std::to_string(p.logprobs) + " must be >= 0 (or None)");
  if (p.prompt_logprobs < -1)
    throw InvalidArgument("prompt_logprobs", std::to_string(p.prompt_logprobs) + " must be >= 0 (or None)");
  if (p.logprobs > kMaxLogprobs)
    throw InvalidArgument("logprobs", std::to_string(p.logprobs) + " must be <= " + std::to_string(kMaxLogprobs));
  if (p.prompt_logprobs > kMaxLogprobs)
    throw InvalidArgument("prompt_logprobs",
                          std::to_string(p.prompt_logprobs) + " must be <= " + std::to_string(kMaxLogprobs));
  for (const auto& [t, b] : p.logit_bias)  // (a NaN/inf bias would poison the row's logits)
    if (!(b >= -kMaxLogitBias && b <= kMaxLogitBias))
      throw InvalidArgument("logit_bias", "bias " + num(b) + " of token " + std::to_string(t) + " must be in [-" +
                                              num(kMaxLogitBias) + ", " + num(kMaxLogitBias) + "]");
  if (vocab > 0 && p.logprobs > vocab)
    throw InvalidArgument("logprobs", std::to_string(p.logprobs) + " exceeds the vocabulary size " + std::to_string(vocab));
  if (vocab > 0 && p.prompt_logprobs > vocab)
    throw InvalidArgument("prompt_logprobs",
                          std::to_string(p.prompt_logprobs) + " exceeds the vocabulary size " + std::to_string(vocab));
  check_ids("stop_token_ids", p.stop_token_ids, vocab);
  check_ids("allowed_token_ids", p.allowed_token_ids, vocab);
  check_ids("banned_token_ids", p.banned_token_ids, vocab);
  for (const auto& [t, b] : p.logit_bias)
    if (t < 0 || (vocab > 0 && t >= vocab))
      throw InvalidArgument("logit_bias", "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                              std::to_string(vocab) + ")");
}

}  // namespace deepinfer

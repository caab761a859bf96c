#include "core/sampling_params.h"

#include <charconv>
#include <cmath>
#include <string>

#include "core/invalid_argument.h"

namespace deepinfer {

namespace {
// The shortest text that reads back as v (0.9 -> "0.9", 2 -> "2", 1e300 -> "1e+300", nan).
std::string num(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
// The float32 the sampler inputs carry for v: finite and, where positive, still positive
// (1e300 would be inf, 1e-50 a zero temperature divisor or top_p).
bool f32_finite(double v) { return std::isfinite(static_cast<float>(v)); }
bool f32_positive(double v) { return static_cast<float>(v) > 0.0f; }
// Token ids in [0, vocab) (vocab 0: unknown, only >= 0).
void check_id(const char* field, int32_t t, int32_t vocab) {
  if (t < 0 && vocab <= 0) throw InvalidArgument(field, "token id " + std::to_string(t) + " must be >= 0");
  if (t < 0 || (vocab > 0 && t >= vocab))
    throw InvalidArgument(field, "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                     std::to_string(vocab) + ")");
}
void check_ids(const char* field, const std::vector<int32_t>& ids, int32_t vocab) {
  for (int32_t t : ids) check_id(field, t, vocab);
}
}  // namespace

void SamplingParams::validate(int32_t vocab) const {
  const SamplingParams& p = *this;
  if (p.n < 1) throw InvalidArgument("n", std::to_string(p.n) + " must be >= 1");
  if (!(p.temperature >= 0.0) || !f32_finite(p.temperature))
    throw InvalidArgument("temperature", num(p.temperature) + " must be a finite value >= 0");
  if (!(p.top_p > 0.0 && p.top_p <= 1.0) || !f32_positive(p.top_p))
    throw InvalidArgument("top_p", num(p.top_p) + " must be in (0, 1]");
  if (p.top_k < -1 || p.top_k == 0) throw InvalidArgument("top_k", std::to_string(p.top_k) + " must be -1 (off) or >= 1");
  if (!(p.min_p >= 0.0 && p.min_p <= 1.0)) throw InvalidArgument("min_p", num(p.min_p) + " must be in [0, 1]");
  if (!(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0))
    throw InvalidArgument("presence_penalty", num(p.presence_penalty) + " must be in [-2, 2]");
  if (!(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0))
    throw InvalidArgument("frequency_penalty", num(p.frequency_penalty) + " must be in [-2, 2]");
  if (!(p.repetition_penalty > 0.0) || !f32_finite(p.repetition_penalty) || !f32_positive(p.repetition_penalty))
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
  for (size_t w = 0; w < p.bad_words_token_ids.size(); ++w) {
    if (p.bad_words_token_ids[w].empty())
      throw InvalidArgument("bad_words_token_ids", "word " + std::to_string(w) + " has no tokens");
    check_ids("bad_words_token_ids", p.bad_words_token_ids[w], vocab);
  }
  for (const auto& [t, b] : p.logit_bias) check_id("logit_bias", t, vocab);
}

}  // namespace deepinfer

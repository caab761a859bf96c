// SamplingParams::validate and the bad-words matcher of the sampler inputs (match_bad_words),
// driven from C++ alone; expected bans computed by hand.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "check.h"
#include "core/invalid_argument.h"
#include "core/sampling_params.h"
#include "step/sampler_inputs.h"

using namespace deepinfer;

namespace {

using Words = std::vector<std::vector<int32_t>>;

std::vector<int32_t> bans(const Words& words, const std::vector<int32_t>& known, const std::vector<int32_t>& drafts,
                          bool complete = true) {
  std::vector<int32_t> out;
  match_bad_words(words, known.data(), known.size(), drafts.data(), drafts.size(), complete, out);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

using V = std::vector<int32_t>;

void test_bad_words_matcher() {
  const Words words = {{8, 9}, {5}, {7, 8, 10}, {3, 7, 11}, {8, 8, 12}};
  CHECK(bans(words, {}, {}) == V({5}));                   // no output yet: only the one-token word
  CHECK(bans(words, {7}, {}) == V({5}));                  // 7: no word's other tokens
  CHECK(bans(words, {7, 8}, {}) == V({5, 9, 10}));        // ... 8 -> 9, ... 7 8 -> 10
  CHECK(bans(words, {3, 7, 8}, {}) == V({5, 9, 10}));     // [3, 7] is not the end
  CHECK(bans(words, {3, 7}, {}) == V({5, 11}));
  CHECK(bans(words, {9, 8, 8}, {}) == V({5, 9, 12}));
  // the history continues into draft tokens (a speculative row's bonus token)
  CHECK(bans(words, {7}, {8}) == V({5, 9, 10}));
  CHECK(bans(words, {}, {7, 8}) == V({5, 9, 10}));
  CHECK(bans(words, {3}, {7}) == V({5, 11}));
  // the latest token pending on the device: only one-token words
  CHECK(bans(words, {7, 8}, {}, false) == V({5}));
  // the same last token from two words, and a repeated word: appended unsorted, possibly twice
  std::vector<int32_t> raw;
  const std::vector<int32_t> known = {4};
  match_bad_words({{4, 6}, {6}, {6}}, known.data(), known.size(), nullptr, 0, true, raw);
  CHECK(raw == V({6, 6, 6}));
}

void test_validate_bad_words_and_float32_values() {
  SamplingParams p;
  p.bad_words_token_ids = {{1, 2}, {}};
  CHECK_INVALID_ARGUMENT(p.validate(0), "bad_words_token_ids");
  p.bad_words_token_ids = {{1, 100}};
  p.validate(0);
  CHECK_INVALID_ARGUMENT(p.validate(100), "bad_words_token_ids");
  p.validate(101);
  p.bad_words_token_ids = {{-1}};
  CHECK_INVALID_ARGUMENT(p.validate(0), "bad_words_token_ids");
  SamplingParams one_token_words, two_token_word;
  one_token_words.bad_words_token_ids = {{3}, {4}};
  two_token_word.bad_words_token_ids = {{3}, {4, 5}};
  CHECK(!one_token_words.has_multi_token_bad_words());
  CHECK(two_token_word.has_multi_token_bad_words());
  // finite doubles the float32 sampler inputs cannot carry
  SamplingParams q;
  q.temperature = 1e300;
  CHECK_INVALID_ARGUMENT(q.validate(0), "temperature");
  q.temperature = 1e-300;  // a float32 0: greedy, as the sampler sees it
  q.validate(0);
  CHECK(q.is_greedy());
  q.top_p = 1e-50;
  CHECK_INVALID_ARGUMENT(q.validate(0), "top_p");
  q.top_p = 1.0;
  q.repetition_penalty = 1e-50;  // a zero divisor as float32
  CHECK_INVALID_ARGUMENT(q.validate(0), "repetition_penalty");
  q.repetition_penalty = std::numeric_limits<double>::quiet_NaN();
  CHECK_INVALID_ARGUMENT(q.validate(0), "repetition_penalty");
}

}  // namespace

int main() {
  RUN(test_bad_words_matcher);
  RUN(test_validate_bad_words_and_float32_values);
  return 0;
}

// Per-request outputs (RequestOutput) built after each update, recycled through a pool.
//
// The data is plain C++; Python reads it through properties that convert on access, so
// building an output costs a few copies of the new tokens, not Python objects per token.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "scheduler.h"

namespace deepinfer {

struct CompletionData {
  int32_t index = 0;
  std::vector<int32_t> token_ids;
  double cumulative_logprob = 0.0;
  int32_t logprobs_per_token = 0;  // 0: logprobs not requested; else 1 + k
  std::vector<int32_t> logprob_token_ids;
  std::vector<float> logprob_values;
  const char* finish_reason = nullptr;  // "stop" / "length" / "abort" / "ignored"
  int64_t stop_token = -1;
  std::string stop_string;
  bool stop_is_string = false;
  std::string text;  // written by the Python detokenizer
};

struct RequestMetricsData {
  double arrival_time = 0.0, first_scheduled_time = 0.0, first_token_time = 0.0, finished_time = 0.0;
  int32_t num_cached_tokens = 0;
};

struct RequestOutputData {
  std::string request_id;
  std::shared_ptr<const std::vector<int32_t>> prompt_token_ids;
  std::vector<CompletionData> completions;  // [0, num_completions) valid; capacity reused
  int32_t num_completions = 0;
  bool finished = false;
  int32_t prompt_logprobs_per_token = 0;  // 0: not requested; else 1 + k
  int32_t prompt_logprobs_start = 0;      // prompt positions [start, end) covered; 0 = the leading None
  int32_t prompt_logprobs_end = 0;
  std::vector<int32_t> prompt_logprob_token_ids;  // positions [max(start, 1), end), per_token each
  std::vector<float> prompt_logprob_values;
  RequestMetricsData metrics;
};

// Pool of Python-wrapped RequestOutputData: an object is reused once nothing outside the pool
// references it (its refcount is back to 1).
class RequestOutputPool {
 public:
  explicit RequestOutputPool(size_t max_size) : max_size_(max_size) {}
  // Call with the GIL held, once per build: finds the reusable objects.
  void collect();
  // A cleared-for-reuse object (the GIL held).
  std::pair<pybind11::object, RequestOutputData*> acquire();
  size_t size() const { return objs_.size(); }
  size_t max_size() const { return max_size_; }
  size_t num_free() const { return free_.size(); }

 private:
  size_t max_size_;
  std::vector<std::pair<pybind11::object, RequestOutputData*>> objs_;
  std::vector<size_t> free_;
};

// Outputs of every request updated since the last call (or schedule()), per its output kind.
pybind11::list build_request_outputs(Scheduler& sched, RequestOutputPool& pool);

// After Scheduler::stop_sequence(s, ...) on a sequence whose request is in `d` (its output from
// the last build): corrects d's completion of that sequence in place (tokens cut at the stop,
// finish and stop reason, d.finished) so the request need not be built again; old_num_output_tokens
// is the sequence's output length before stop_sequence. Returns false, changing nothing, when d
// holds no completion of the sequence (the next build then reports it).
bool correct_output_after_stop(Scheduler& sched, SeqIndex s, int32_t old_num_output_tokens, RequestOutputData& d);

}  // namespace deepinfer

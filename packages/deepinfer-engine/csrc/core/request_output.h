// Per-request outputs (RequestOutput) built after each update.
//
// The data is plain C++; Python reads it through properties that convert on access, so
// building an output costs a few copies of the new tokens, not Python objects per token. The
// binding recycles the objects through a pool (python/request_output_pool.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/scheduler.h"

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

// The plain deltas of chosen requests as rows of columns instead of RequestOutputData (a serving
// engine core then handles a step's tokens without an object per request). A request registered
// in `slots` (request id -> the caller's slot number) whose output is of the delta kind, with one
// sample (n == 1), no logprobs and no prompt logprobs, after its first output and not finished,
// gets one row: its slot and its new tokens (possibly none). Its other outputs (the first, the
// finished one, an abort) are built as RequestOutputData; building its finished one unregisters it
// (whatever its kind).
struct DeltaColumns {
  std::unordered_map<std::string, int32_t> slots;
  std::vector<int32_t> row_slots;   // one per row, in build order
  std::vector<int64_t> offsets{0};  // row r's tokens: tokens[offsets[r], offsets[r + 1])
  std::vector<int32_t> tokens;
  void clear_rows() {
    row_slots.clear();
    offsets.assign(1, 0);
    tokens.clear();
  }
};

// Outputs of every request updated since the last call (or schedule()), per its output kind.
// `acquire` hands out the object to fill for each output, in order (its old contents are
// overwritten); then the updated-sequence list is drained. `columns` (may be null): the requests
// whose plain deltas become rows there instead (appended to the rows already there).
void build_request_outputs(Scheduler& sched, const std::function<RequestOutputData&()>& acquire,
                           DeltaColumns* columns = nullptr);

// After Scheduler::stop_sequence(s, ...) on a sequence whose request is in `d` (its output from
// the last build): corrects d's completion of that sequence in place (tokens cut at the stop,
// finish and stop reason, d.finished) so the request need not be built again; old_num_output_tokens
// is the sequence's output length before stop_sequence. Returns false, changing nothing, when d
// holds no completion of the sequence (the next build then reports it).
bool correct_output_after_stop(Scheduler& sched, SeqIndex s, int32_t old_num_output_tokens, RequestOutputData& d);

}  // namespace deepinfer

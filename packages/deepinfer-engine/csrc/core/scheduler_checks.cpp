// Validation of a scheduler's configuration and of each request it is given.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "core/invalid_argument.h"
#include "core/scheduler.h"

namespace deepinfer {

namespace {
std::string outside_vocab(int64_t id, int32_t vocab) {
  return std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
}
}  // namespace

const SchedulerConfig& SchedulerConfig::validated() const {
  auto positive = [](const char* name, int64_t v) {
    if (v < 1) throw InvalidArgument(name, std::to_string(v) + " must be >= 1");
  };
  positive("num_blocks", num_blocks);
  positive("block_size", block_size);
  positive("max_num_seqs", max_num_seqs);
  positive("max_num_batched_tokens", max_num_batched_tokens);
  positive("max_model_len", max_model_len);
  positive("vocab_size", vocab_size);
  if (eos_token_id < -1 || eos_token_id >= vocab_size) throw InvalidArgument("eos_token_id", outside_vocab(eos_token_id, vocab_size));
  if (long_prefill_token_threshold < 0)
    throw InvalidArgument("long_prefill_token_threshold", std::to_string(long_prefill_token_threshold) + " must be >= 0");
  if (!(watermark >= 0.0 && watermark < 1.0))
    throw InvalidArgument("watermark", std::to_string(watermark) + " must be in [0, 1)");
  if (num_lookahead_slots < 0)
    throw InvalidArgument("num_lookahead_slots", std::to_string(num_lookahead_slots) + " must be >= 0");
  if (num_state_slots < 0 || (num_state_slots > 0 && num_state_slots < max_num_seqs))
    throw InvalidArgument("num_state_slots", std::to_string(num_state_slots) + " must be 0 or >= max_num_seqs (" +
                                                 std::to_string(max_num_seqs) + ")");
  if (hash_bits < 1 || hash_bits > 64) throw InvalidArgument("hash_bits", std::to_string(hash_bits) + " must be in [1, 64]");
  if (!enable_chunked_prefill && max_num_batched_tokens < max_model_len)
    throw InvalidArgument("max_num_batched_tokens", std::to_string(max_num_batched_tokens) + " must be >= max_model_len (" +
                                                        std::to_string(max_model_len) + ") without chunked prefill");
  const int64_t wm = static_cast<int64_t>(watermark * num_blocks);
  const int64_t need = (static_cast<int64_t>(max_model_len) + num_lookahead_slots + block_size - 1) / block_size;
  if (need > num_blocks - wm)
    throw InvalidArgument("num_blocks", std::to_string(num_blocks) + " blocks (" + std::to_string(wm) +
                                            " kept by the watermark) cannot hold one sequence of max_model_len " +
                                            std::to_string(max_model_len) + " (+ lookahead): need " + std::to_string(need));
  // The per-block tables are allocated up front: refuse sizes this machine cannot hold (a huge
  // num_blocks would otherwise be OOM-killed while the pages are touched). Bound: half of the
  // physical memory, and the address-space limit when one is set.
  const uint64_t bytes = BlockManager::host_bytes(num_blocks, block_size, enable_prefix_caching);
  uint64_t limit = UINT64_MAX;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) limit = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2;
  struct rlimit as {};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
    limit = std::min<uint64_t>(limit, static_cast<uint64_t>(as.rlim_cur));
  if (bytes > limit)
    throw InvalidArgument("num_blocks", std::to_string(num_blocks) + " blocks need " + std::to_string(bytes >> 20) +
                                            " MiB of host bookkeeping, more than the " + std::to_string(limit >> 20) +
                                            " MiB allowed (half of the physical memory, or the address-space limit)");
  return *this;
}

void Scheduler::check_request(const std::string& request_id, const int32_t* prompt, size_t prompt_len,
                              const SamplingParams& params, double arrival_time, int32_t eos_token_id) const {
  const int32_t vocab = cfg_.vocab_size;
  if (request_id == kPlaceholderRequestId)
    throw InvalidArgument("request_id", "'" + request_id + "' is reserved for padding rows");
  if (request_id_in_use(request_id)) throw InvalidArgument("request_id", "'" + request_id + "' is already in use");
  if (prompt_len == 0) throw InvalidArgument("prompt_token_ids", "must not be empty");
  for (size_t i = 0; i < prompt_len; ++i)
    if (prompt[i] < 0 || prompt[i] >= vocab)
      throw InvalidArgument("prompt_token_ids", "token id " + std::to_string(prompt[i]) + " at index " +
                                                    std::to_string(i) + " is outside the vocabulary [0, " +
                                                    std::to_string(vocab) + ")");
  params.validate(vocab);
  if (params.n > cfg_.max_num_seqs)
    throw InvalidArgument("n", std::to_string(params.n) + " exceeds max_num_seqs " + std::to_string(cfg_.max_num_seqs));
  if (eos_token_id < -1 || eos_token_id >= vocab) throw InvalidArgument("eos_token_id", outside_vocab(eos_token_id, vocab));
  if (!std::isfinite(arrival_time))
    throw InvalidArgument("arrival_time", std::to_string(arrival_time) + " must be a finite time.time() value");
  if (prompt_len > static_cast<size_t>(INT32_MAX / 2))
    throw InvalidArgument("prompt_token_ids", std::to_string(prompt_len) + " tokens is too many");
}

}  // namespace deepinfer

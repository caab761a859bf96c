#include "step/prompt_logprobs.h"

#include <string>
#include <unordered_map>

#include "core/invalid_argument.h"

namespace deepinfer {

void update_prompt_logprobs(Scheduler& s, const PromptLogprobInputs& in, const float* target_logprobs,
                            const int32_t* topk_ids, const float* topk_logprobs, int32_t k) {
  // Pass 1: every row must continue its request's prompt logprobs in order.
  std::unordered_map<GroupIndex, int32_t> next;  // group -> next position expected
  for (int32_t r = 0; r < in.num_rows; ++r) {
    const SeqIndex si = s.find_seq(in.seq_ids.data[r]);
    if (si == kNoSeq)
      throw InvalidArgument("prompt_logprob_inputs", "row " + std::to_string(r) + " names seq_id " +
                                  std::to_string(in.seq_ids.data[r]) + " which is no longer live");
    const GroupIndex g = s.store().seq(si).group;
    auto it = next.try_emplace(g, s.store().groups[g].num_prompt_logprobs + 1).first;
    const int32_t pos = in.positions.data[r];
    if (pos != it->second)
      throw InvalidArgument("prompt_logprob_inputs", "row " + std::to_string(r) + " is prompt position " +
                                  std::to_string(pos) + " but the request expects position " +
                                  std::to_string(it->second) + " next (chunks must arrive in order)");
    const int32_t want = in.num_logprobs.data[r];
    if (want > k)
      throw InvalidArgument("topk_token_ids", "row " + std::to_string(r) + " asks for " + std::to_string(want) +
                                  " prompt logprobs but k = " + std::to_string(k));
    // Top-k ids become RequestOutput.prompt_logprobs keys: they must be vocabulary ids.
    const int32_t vocab = s.config().vocab_size;
    for (int32_t j = 0; j < want; ++j) {
      const int32_t id = topk_ids[static_cast<size_t>(r) * k + j];
      if (id < 0 || (vocab > 0 && id >= vocab))
        throw InvalidArgument("topk_token_ids", "row " + std::to_string(r) + " column " + std::to_string(j) +
                                    " is " + std::to_string(id) + ", outside the vocabulary [0, " +
                                    std::to_string(vocab) + ")");
    }
    ++it->second;
  }
  // Pass 2: append.
  for (int32_t r = 0; r < in.num_rows; ++r) {
    SequenceGroup& g = s.store().group_of(s.find_seq(in.seq_ids.data[r]));
    g.prompt_logprob_token_ids.push_back(in.target_token_ids.data[r]);
    g.prompt_logprob_values.push_back(target_logprobs[r]);
    for (int32_t j = 0; j < in.num_logprobs.data[r]; ++j) {
      g.prompt_logprob_token_ids.push_back(topk_ids[static_cast<size_t>(r) * k + j]);
      g.prompt_logprob_values.push_back(topk_logprobs[static_cast<size_t>(r) * k + j]);
    }
    ++g.num_prompt_logprobs;
  }
}

}  // namespace deepinfer

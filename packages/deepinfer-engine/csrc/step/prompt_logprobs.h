// update_prompt_logprobs: appends the prompt logprobs of a prefill chunk to the request
// (SequenceGroup::prompt_logprob_*; 1 + k entries per prompt position 1..P-1).
#pragma once

#include <cstdint>

#include "step/sampler_inputs.h"
#include "core/scheduler.h"

namespace deepinfer {

// Rows of `in` (the step's PromptLogprobInputs). Validates order/positions and throws
// InvalidArgument naming the row before anything is written.
void update_prompt_logprobs(Scheduler& s, const PromptLogprobInputs& in, const float* target_logprobs,
                            const int32_t* topk_ids, const float* topk_logprobs, int32_t k);

}  // namespace deepinfer

// YOCO-style (decoder-decoder) prefill truncation: which rows continue past the self-decoder.
#pragma once

#include <cstdint>

namespace deepinfer {

enum class YocoPrefillTruncationMode : uint8_t {
  NONE = 0,         // every row runs every layer (no kept-row output)
  LAST_TOKEN = 1,   // each sequence's final row of the step
  LOGITS_ROWS = 2,  // every row whose logits are needed (sampling, prompt logprobs, speculative)
};

}  // namespace deepinfer

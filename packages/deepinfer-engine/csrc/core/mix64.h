// splitmix64's finalizer: a fast bijective 64-bit mix (prefix-cache hashes, cache-salt seeds,
// per-sequence sampler seeds). Not cryptographic.
#pragma once

#include <cstdint>

namespace deepinfer {

inline uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace deepinfer

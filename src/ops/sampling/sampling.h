// Token sampling from one logits row: greedy, or temperature + top-k + top-p with a seeded generator.
#pragma once

#include <cstdint>
#include <random>

namespace bg::ops {

struct SamplingParams {
  float temperature = 0.0f;  // <= 0: greedy
  int64_t top_k = 0;         // 0: all
  float top_p = 1.0f;        // (0, 1]
};

// Greedy: the highest logit, lowest index on ties. NaN logits are an error.
int32_t argmax(const float* logits, int64_t vocab);

// Samples one id. `rng` advances by exactly one draw for non-greedy sampling.
int32_t sample_token(const SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng);

}  // namespace bg::ops

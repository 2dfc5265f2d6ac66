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

// Samples one id with a given uniform u in [0, 1). Candidates are sorted by logit (descending, lower index first on
// ties) and cut to the top k; softmax at the temperature (double); top-p keeps the smallest prefix whose mass reaches
// top_p; then the id whose cumulative kept mass first exceeds u * kept is chosen. The CUDA sampler follows these rules,
// so both choose the same id for the same u (up to rounding of the sums at a boundary). Greedy (temperature <= 0)
// ignores u. NaN logits, u outside [0, 1), top_p outside (0, 1] and negative top_k are errors.
int32_t sample_token_with_uniform(const SamplingParams& p, const float* logits, int64_t vocab, double u);

// Samples one id: draws u ~ U[0, 1) from `rng` (exactly one draw for non-greedy sampling, none for greedy), then
// sample_token_with_uniform.
int32_t sample_token(const SamplingParams& p, const float* logits, int64_t vocab, std::mt19937_64& rng);

}  // namespace bg::ops

// Rotary position embedding: inverse frequencies (default or YaRN, as transformers computes them) and the rotation
// of a slice of each head, interleaved pairs (GPT-J, DeepSeek's rope_interleave=True) or halves (NeoX).
#pragma once

#include <cstdint>
#include <vector>

#include "formats/model_config.h"
#include "ops/rope/rope_params.h"

namespace bg::ops {

struct RopeTable {
  std::vector<float> inv_freq;  // [rope_dim / 2]
  float attention_factor = 1.0f;  // multiplies cos and sin
};

// rope_dim: rotated dims per head; max_position_embeddings: the config value (YaRN uses max/original as factor when
// original_max_position_embeddings is given, as transformers 5 does).
RopeTable compute_rope_table(const RopeConfig& rope, int64_t rope_dim, int64_t max_position_embeddings);

// YaRN softmax-scale multiplier: m^2 with m = 0.1 * mscale_all_dim * ln(factor) + 1 (1 when not YaRN, factor <= 1 or
// mscale_all_dim is 0). Uses the config's `factor`, as DeepseekV3Attention does.
double yarn_softmax_scale_multiplier(const RopeConfig& rope);

// Rotates x in place: token t at position positions[t].
void apply_rope_cpu(const RopeParams& p, const RopeTable& table, const int64_t* positions, float* x);

}  // namespace bg::ops

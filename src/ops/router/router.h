// MoE router (DeepSeek-V3 noaux_tc / Kimi): sigmoid scores, a correction bias used for selection only, grouped top-k
// (top-2 sum per group, keep topk_group groups), renormalisation and the routed scaling factor. fp32 throughout.
#pragma once

#include <cstdint>

namespace bg::ops {

struct RouterParams {
  int64_t n_tokens = 0;
  int64_t n_experts = 0;
  int64_t top_k = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool renormalize = true;
  float scaling_factor = 1.0f;
};

// logits: [n_tokens, n_experts] (x W_gate^T); bias: [n_experts] or null.
// expert_ids: [n_tokens, top_k] int32, weights: [n_tokens, top_k] fp32, in descending order of biased score.
void route_topk_cpu(const RouterParams& p, const float* logits, const float* bias, int32_t* expert_ids,
                    float* weights);

}  // namespace bg::ops

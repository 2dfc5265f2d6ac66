// CUDA MoE router: fp32 logits + correction bias -> top-k expert ids and routing weights, with exactly the rules of
// route_topk_cpu (router.h). Included only by CUDA code, the CUDA backend and GPU tests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/router/router.h"

namespace bg::ops {

inline constexpr int64_t kRouterCudaMaxExperts = 1024;
inline constexpr int64_t kRouterCudaMaxTopK = 32;

// logits: [n_tokens, n_experts] fp32 (device); bias: [n_experts] fp32 (device) or null.
// expert_ids: [n_tokens, top_k] int32, weights: [n_tokens, top_k] fp32 (device), in descending order of biased score,
// ties to the lower expert index. One warp per token; n_experts <= 1024, top_k <= 32. No workspace, no host sync.
void route_topk_cuda(const RouterParams& p, const float* logits, const float* bias, int32_t* expert_ids,
                     float* weights, cudaStream_t stream);

}  // namespace bg::ops

// CUDA MoE router: fp32 logits + correction bias -> top-k expert ids and routing weights, with exactly the rules of
// route_topk_cpu (router.h). Included only by CUDA code, the CUDA backend and GPU tests.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "ops/router/router.h"

namespace bg::ops {

inline constexpr int64_t kRouterCudaMaxExperts = 1024;
inline constexpr int64_t kRouterCudaMaxTopK = 32;

// How the kernel takes the top-k (the same ids and weights either way): a bitonic sort of order-preserving keys in
// registers (the default since 2026-12-05: 7.9-8.4 us for top-16 of 896 on the H200), or k rounds of a block argmax
// (9.5-9.8 us in the same run). BG_ROUTER_TOPK=rounds|sort picks the default (read once; anything else throws
// bg::Error naming the variable).
enum class RouterTopk : uint8_t { kRounds, kSort };
RouterTopk router_topk_from_env(const char* env_value);
RouterTopk router_topk_default();

// logits: [n_tokens, n_experts] fp32 (device); bias: [n_experts] fp32 (device) or null.
// expert_ids: [n_tokens, top_k] int32, weights: [n_tokens, top_k] fp32 (device), in descending order of biased score,
// ties to the lower expert index. One block of eight warps per token; n_experts <= 1024, top_k <= 32. No workspace,
// no host sync. `algo`: router_topk_default() when not given.
void route_topk_cuda(const RouterParams& p, const float* logits, const float* bias, int32_t* expert_ids,
                     float* weights, cudaStream_t stream, std::optional<RouterTopk> algo = std::nullopt);

}  // namespace bg::ops

// Launch pieces the two grouped prefill paths' device code shares: moe_grouped_cuda.cu (dequantize once, bf16 GEMMs)
// and moe_fp8_cuda.cu (FP8 GEMMs). Both walk the plan's groups of experts with 256-thread blocks.
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "ops/moe/moe_grouped.h"

namespace bg::ops::grouped {

inline constexpr int kThreads = 256;

// The stored scale byte s' of the W4A16 layout as the fp32 2^(s' - 127) (0 for s' = 0, as the kernel's bf16 scale).
__device__ __forceinline__ float w4_scale(uint32_t s_prime) { return __uint_as_float(s_prime << 23); }

// A W4A16 weight's exact value as the decode kernel computes it and both prefill paths take it: its bf16 lane bits
// (E2M1 sign at bit 15, EEM at bits 8..6: c x 2^-126) times the scale, rounded to bf16 (mul.rn.bf16x2), times
// 2^shift (the kernel's fp32 accumulators' factor), rounded to bf16 again.
__device__ __forceinline__ float w4_weight(uint32_t lane_bits, float scale, float shift) {
  const float prod = __bfloat162float(__float2bfloat16(__uint_as_float(lane_bits << 16) * scale));
  return __bfloat162float(__float2bfloat16(prod * shift));
}

// The slots of one group (a kernel parameter: at most 64 x 4 bytes).
struct GroupSlots {
  int32_t slot[kMoeGroupedMaxGroupExperts];
};

inline GroupSlots group_slots(const MoeGroupedPlan& plan, const MoeGroupedGroup& g) {
  GroupSlots slots{};
  for (int j = 0; j < g.n_experts; ++j) slots.slot[j] = plan.slots[static_cast<size_t>(g.first + j)];
  return slots;
}

// Blocks for `work` threads' worth, at least 1 and at most `cap`.
inline int grid_for(int64_t work, int64_t cap) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, cap)));
}

}  // namespace bg::ops::grouped

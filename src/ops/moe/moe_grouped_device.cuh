// Launch pieces the two grouped prefill paths' device code shares: moe_grouped_cuda.cu (dequantize once, bf16 GEMMs)
// and moe_fp8_cuda.cu (FP8 GEMMs). Both walk the plan's groups of experts with 256-thread blocks.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops/moe/moe_grouped.h"

namespace bg::ops::grouped {

inline constexpr int kThreads = 256;

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

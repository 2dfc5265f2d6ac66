// Host side of the dequantize-once prefill path: the selection threshold, the scratch geometry and the step's plan.
#include "ops/moe/moe_grouped.h"

#include <algorithm>
#include <string_view>

#include "core/env.h"
#include "core/error.h"

namespace bg::ops {

int64_t moe_grouped_min_rows(const char* env_value) {
  if (env_value != nullptr && std::string_view(env_value) == "off") return 0;
  return env_int("BG_MOE_GROUPED_MIN_ROWS", env_value, 1, int64_t{1} << 30).value_or(kMoeGroupedMinRowsDefault);
}


bool moe_grouped_wanted(int64_t n_tokens, int64_t top_k, int64_t n_experts, int64_t min_rows) {
  return min_rows > 0 && n_tokens > 0 && n_tokens * top_k >= min_rows * n_experts;
}

MoePrefillKernel moe_prefill_kernel(const char* env_value) {
  switch (env_choice("BG_MOE_PREFILL", env_value, {"auto", "grouped", "w4a16", "fp8"})) {
    case 1: return MoePrefillKernel::kGrouped;
    case 2: return MoePrefillKernel::kW4a16;
    case 3: return MoePrefillKernel::kFp8;
    default: return MoePrefillKernel::kAuto;
  }
}

size_t moe_grouped_expert_bytes(int64_t hidden, int64_t inter) {
  return static_cast<size_t>(3 * hidden * inter) * 2;
}

int64_t moe_grouped_group_experts(int64_t hidden, int64_t inter, size_t scratch_bytes) {
  const size_t per_expert = moe_grouped_expert_bytes(hidden, inter);
  if (per_expert == 0) return 0;
  return std::min<int64_t>(kMoeGroupedMaxGroupExperts, static_cast<int64_t>(scratch_bytes / per_expert));
}

MoeGroupedPlan moe_grouped_plan(std::span<const int32_t> counts, int64_t hidden, int64_t inter, int64_t group_experts,
                                int64_t max_rows) {
  BG_CHECK(hidden > 0 && inter > 0, "moe grouped plan: expert widths {} / {} must be positive", hidden, inter);
  BG_CHECK(group_experts >= 1 && group_experts <= kMoeGroupedMaxGroupExperts,
           "moe grouped plan: {} experts per group (1..{}); is the scratch smaller than one expert ({} bytes)?",
           group_experts, kMoeGroupedMaxGroupExperts, moe_grouped_expert_bytes(hidden, inter));
  MoeGroupedPlan plan;
  plan.hidden = hidden;
  plan.inter = inter;
  plan.group_experts = group_experts;
  int64_t row = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    BG_CHECK(counts[s] >= 0, "moe grouped plan: slot {} has {} rows", s, counts[s]);
    if (counts[s] == 0) continue;
    plan.slots.push_back(static_cast<int32_t>(s));
    plan.rows.push_back(counts[s]);
    plan.row_begin.push_back(row);
    row += counts[s];
  }
  BG_CHECK(row <= max_rows, "moe grouped plan: {} rows over the slots, but the dispatch has {} pairs", row, max_rows);
  for (int64_t first = 0; first < plan.n_active(); first += group_experts) {
    MoeGroupedGroup g;
    g.first = static_cast<int32_t>(first);
    g.n_experts = static_cast<int32_t>(std::min(group_experts, plan.n_active() - first));
    g.row_begin = plan.row_begin[static_cast<size_t>(first)];
    const size_t last = static_cast<size_t>(first + g.n_experts - 1);
    g.n_rows = plan.row_begin[last] + plan.rows[last] - g.row_begin;
    plan.max_group_rows = std::max(plan.max_group_rows, g.n_rows);
    plan.groups.push_back(g);
  }
  return plan;
}

size_t moe_grouped_gu_bytes(const MoeGroupedPlan& plan) {
  return static_cast<size_t>(plan.max_group_rows * 2 * plan.inter) * 2;
}

size_t moe_grouped_pointer_bytes(const MoeGroupedPlan& plan) {
  return static_cast<size_t>(6 * plan.n_active()) * sizeof(void*);
}

}  // namespace bg::ops

// Host side of the grouped prefill path (ops/moe/moe_grouped.h): the threshold's parsing and selection, the scratch
// geometry, and the plan (touched slots, offsets, groups) against a direct computation.
#include "ops/moe/moe_grouped.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace bg::ops {
namespace {

TEST(MoeGrouped, ThresholdParsing) {
  EXPECT_EQ(moe_grouped_min_rows(nullptr), kMoeGroupedMinRowsDefault);
  EXPECT_EQ(moe_grouped_min_rows(""), kMoeGroupedMinRowsDefault);
  EXPECT_EQ(moe_grouped_min_rows("off"), 0);
  EXPECT_EQ(moe_grouped_min_rows("1"), 1);
  EXPECT_EQ(moe_grouped_min_rows("256"), 256);
  for (const char* bad : {"0", "-4", "12x", "x", "1.5", " 8"}) {
    EXPECT_THROW(moe_grouped_min_rows(bad), Error) << bad;
  }
}

TEST(MoeGrouped, PrefillKernelChoice) {
  EXPECT_EQ(moe_prefill_kernel(nullptr), MoePrefillKernel::kAuto);
  EXPECT_EQ(moe_prefill_kernel(""), MoePrefillKernel::kAuto);
  EXPECT_EQ(moe_prefill_kernel("auto"), MoePrefillKernel::kAuto);
  EXPECT_EQ(moe_prefill_kernel("grouped"), MoePrefillKernel::kGrouped);
  EXPECT_EQ(moe_prefill_kernel("w4a16"), MoePrefillKernel::kW4a16);
  EXPECT_EQ(moe_prefill_kernel("fp8"), MoePrefillKernel::kFp8);
  for (const char* bad : {"W4A16", "1", "tiled", " w4a16", "FP8", "e4m3"}) {
    try {
      moe_prefill_kernel(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("BG_MOE_PREFILL"), std::string::npos) << e.what();
    }
  }
}

TEST(MoeGrouped, SelectionByRowsPerExpert) {
  // K3 EP16 rank: 896 global experts, top-16. 32 rows per expert on average at 1792 tokens.
  EXPECT_FALSE(moe_grouped_wanted(1791, 16, 896, 32));
  EXPECT_TRUE(moe_grouped_wanted(1792, 16, 896, 32));
  EXPECT_TRUE(moe_grouped_wanted(16384, 16, 896, 256));
  EXPECT_FALSE(moe_grouped_wanted(16384, 16, 896, 0));  // off
  EXPECT_FALSE(moe_grouped_wanted(0, 16, 896, 1));      // no tokens
  EXPECT_FALSE(moe_grouped_wanted(64, 16, 56, 32));     // decode batch 64 over 56 experts: 18 rows each
}

TEST(MoeGrouped, ScratchGeometry) {
  EXPECT_EQ(moe_grouped_expert_bytes(3584, 3072), size_t{3} * 3584 * 3072 * 2);  // 66 MB: K3
  EXPECT_EQ(moe_grouped_group_experts(3584, 3072, kMoeGroupedScratchBudgetBytes), 16);
  EXPECT_EQ(moe_grouped_group_experts(7168, 2048, kMoeGroupedScratchBudgetBytes), 12);  // DeepSeek-V3
  EXPECT_EQ(moe_grouped_group_experts(3584, 3072, moe_grouped_expert_bytes(3584, 3072) - 1), 0);
  EXPECT_EQ(moe_grouped_group_experts(64, 32, size_t{1} << 40), kMoeGroupedMaxGroupExperts);
}

TEST(MoeGrouped, PlanMatchesCounts) {
  const std::vector<int32_t> counts = {0, 5, 3, 0, 0, 7, 1, 0, 2};
  const MoeGroupedPlan plan = moe_grouped_plan(counts, 64, 32, 2, 100);
  EXPECT_EQ(plan.slots, (std::vector<int32_t>{1, 2, 5, 6, 8}));
  EXPECT_EQ(plan.rows, (std::vector<int32_t>{5, 3, 7, 1, 2}));
  EXPECT_EQ(plan.row_begin, (std::vector<int64_t>{0, 5, 8, 15, 16}));
  ASSERT_EQ(plan.groups.size(), 3u);
  const int64_t want[3][4] = {{0, 2, 0, 8}, {2, 2, 8, 8}, {4, 1, 16, 2}};  // first, experts, row_begin, rows
  for (size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(plan.groups[g].first, want[g][0]);
    EXPECT_EQ(plan.groups[g].n_experts, want[g][1]);
    EXPECT_EQ(plan.groups[g].row_begin, want[g][2]);
    EXPECT_EQ(plan.groups[g].n_rows, want[g][3]);
  }
  EXPECT_EQ(plan.max_group_rows, 8);
  EXPECT_EQ(moe_grouped_gu_bytes(plan), size_t{8} * 2 * 32 * 2);
  EXPECT_EQ(moe_grouped_pointer_bytes(plan), 6 * 5 * sizeof(void*));
  // One group holds everything.
  const MoeGroupedPlan one = moe_grouped_plan(counts, 64, 32, kMoeGroupedMaxGroupExperts, 18);
  ASSERT_EQ(one.groups.size(), 1u);
  EXPECT_EQ(one.groups[0].n_rows, 18);
  // Nothing routed: an empty plan.
  const std::vector<int32_t> none(7, 0);
  const MoeGroupedPlan empty = moe_grouped_plan(none, 64, 32, 4, 0);
  EXPECT_EQ(empty.n_active(), 0);
  EXPECT_TRUE(empty.groups.empty());
  EXPECT_EQ(moe_grouped_gu_bytes(empty), 0u);
}

TEST(MoeGrouped, PlanRejectsBadInput) {
  const std::vector<int32_t> counts = {4, 4};
  EXPECT_THROW(moe_grouped_plan(counts, 64, 32, 0, 8), Error);                               // no room for an expert
  EXPECT_THROW(moe_grouped_plan(counts, 64, 32, kMoeGroupedMaxGroupExperts + 1, 8), Error);  // too many per group
  EXPECT_THROW(moe_grouped_plan(counts, 64, 32, 2, 7), Error);                               // more rows than pairs
  EXPECT_THROW(moe_grouped_plan(std::vector<int32_t>{3, -1}, 64, 32, 2, 8), Error);          // negative count
  EXPECT_THROW(moe_grouped_plan(counts, 0, 32, 2, 8), Error);
}

}  // namespace
}  // namespace bg::ops

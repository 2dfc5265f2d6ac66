// Scheduling policies over plain numbers: token budget, admission (slots, blocks, watermark, max_num_seqs), length
// limits.
#include <gtest/gtest.h>

#include "sched/policies.h"

namespace bg::sched {
namespace {

TEST(TokenBudget, GrantsUntilSpent) {
  TokenBudget b(10);
  EXPECT_EQ(b.take(1), 1);
  EXPECT_EQ(b.take(6), 6);
  EXPECT_EQ(b.take(6), 3);  // only 3 left: a prompt chunk is cut here
  EXPECT_EQ(b.take(1), 0);
  EXPECT_EQ(b.left(), 0);
}

TEST(Blocks, RoundUp) {
  EXPECT_EQ(blocks_for_tokens(0, 4), 0);
  EXPECT_EQ(blocks_for_tokens(1, 4), 1);
  EXPECT_EQ(blocks_for_tokens(4, 4), 1);
  EXPECT_EQ(blocks_for_tokens(5, 4), 2);
}

TEST(AdmissionPolicy, NeedsBlocksForAllTokensPlusWatermark) {
  AdmissionPolicy a(/*max_num_seqs=*/4, /*watermark=*/0.1);
  PoolState p{.block_tokens = 4, .free_blocks = 10, .total_blocks = 40, .free_slots = 2, .total_slots = 4};
  // 33 tokens = 9 blocks; with one sequence running the watermark is ceil(0.1 x 40) = 4 blocks -> 13 > 10.
  EXPECT_EQ(a.headroom_blocks(p, 1), 4);
  EXPECT_FALSE(a.admit(p, 1, 33));
  EXPECT_TRUE(a.admit(p, 1, 24));   // 6 + 4 = 10 blocks
  EXPECT_FALSE(a.admit(p, 1, 25));  // 7 + 4
  // Nothing running: no watermark, so a request as long as the pool allows can always start.
  EXPECT_TRUE(a.admit(p, 0, 40));
  EXPECT_FALSE(a.admit(p, 0, 41));
}

TEST(AdmissionPolicy, WatermarkIsAtLeastOneBlock) {
  AdmissionPolicy a(4, 0.0);
  PoolState p{.block_tokens = 4, .free_blocks = 3, .total_blocks = 3, .free_slots = 4, .total_slots = 4};
  EXPECT_EQ(a.headroom_blocks(p, 2), 1);
  EXPECT_FALSE(a.admit(p, 2, 12));
  EXPECT_TRUE(a.admit(p, 2, 8));
}

TEST(AdmissionPolicy, NeedsAStateSlotAndRoomInTheBatch) {
  AdmissionPolicy a(2, 0.0);
  PoolState p{.block_tokens = 4, .free_blocks = 100, .total_blocks = 100, .free_slots = 0, .total_slots = 4};
  EXPECT_FALSE(a.admit(p, 1, 4));  // no free slot
  p.free_slots = 1;
  EXPECT_TRUE(a.admit(p, 1, 4));
  EXPECT_FALSE(a.admit(p, 2, 4));  // max_num_seqs running
  p.total_slots = 0;               // a model without state slots (DeepSeek-V3)
  p.free_slots = 0;
  EXPECT_TRUE(a.admit(p, 1, 4));
}

TEST(PreemptionPolicy, PicksTheNewest) {
  EXPECT_EQ(PreemptionPolicy().victim(5), 4u);
  EXPECT_EQ(PreemptionPolicy().victim(1), 0u);
}

TEST(LengthLimits, RejectPromptsWithoutRoomAndCapMaxTokens) {
  EXPECT_EQ(check_length(10, 5, 100).max_new_tokens, 5);
  EXPECT_EQ(check_length(90, 50, 100).max_new_tokens, 10);
  EXPECT_EQ(check_length(99, 50, 100).max_new_tokens, 1);
  LengthDecision d = check_length(100, 5, 100);
  EXPECT_NE(d.error.find("maximum context length is 100 tokens, but the prompt has 100"), std::string::npos) << d.error;
  EXPECT_FALSE(check_length(150, 5, 100).error.empty());
}

}  // namespace
}  // namespace bg::sched

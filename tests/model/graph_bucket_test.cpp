// The decode graph buckets (model/forward_common.h): which batch a step of n sequences is padded to.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/forward_common.h"

namespace bg::testing {
namespace {

TEST(GraphBucket, FineBucketsAboveSixteen) {
  const std::vector<std::pair<int64_t, int64_t>> want{
      {1, 1},   {2, 2},   {3, 4},    {5, 8},    {9, 16},   {16, 16},  {17, 24},  {24, 24},  {25, 32},  {33, 40},
      {41, 48}, {57, 64}, {64, 64},  {65, 96},  {96, 96},  {97, 128}, {129, 160}, {200, 224}, {256, 256},
      {257, 320}, {500, 512}, {513, 576}};
  for (const auto& [n, bucket] : want) EXPECT_EQ(graph_bucket(n, 1024, false), bucket) << n;
}

TEST(GraphBucket, EveryBucketHoldsItsStepAndNeverPassesThePowerOfTwo) {
  for (const bool pow2 : {false, true}) {
    int64_t last = 0;
    for (int64_t n = 1; n <= 1024; ++n) {
      const int64_t b = graph_bucket(n, 1024, pow2);
      ASSERT_GE(b, n);
      ASSERT_LE(b, static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(n))));
      ASSERT_GE(b, last);  // monotone: a larger step never takes a smaller graph
      ASSERT_EQ(graph_bucket(b, 1024, pow2), b);  // a bucket is its own bucket
      if (pow2) {
        ASSERT_TRUE(std::has_single_bit(static_cast<uint64_t>(b)));
      }
      last = b;
    }
  }
  // Past the largest graph batch, or empty: no graph.
  EXPECT_EQ(graph_bucket(65, 64, false), 0);
  EXPECT_EQ(graph_bucket(0, 64, false), 0);
  EXPECT_EQ(graph_bucket(64, 64, false), 64);
}

TEST(GraphBucket, PolicyFromTheEnvironment) {
  EXPECT_FALSE(graph_buckets_pow2(nullptr));
  EXPECT_FALSE(graph_buckets_pow2(""));
  EXPECT_FALSE(graph_buckets_pow2("fine"));
  EXPECT_TRUE(graph_buckets_pow2("pow2"));
  EXPECT_THROW(graph_buckets_pow2("powers"), Error);
}

TEST(StepTableWidth, ContextsUpTo16kShareOneWidth) {
  // 64-token blocks, a 256k-position model: every context up to 16k tokens (256 blocks) is one width, so one decode
  // graph per batch bucket; longer ones round up to a power of two.
  for (const int64_t widest : {0, 1, 2, 17, 255, 256}) EXPECT_EQ(step_table_width(widest, 64, 262144), 256) << widest;
  EXPECT_EQ(step_table_width(257, 64, 262144), 512);
  EXPECT_EQ(step_table_width(4096, 64, 262144), 4096);
  // Smaller blocks: the same 16k tokens.
  EXPECT_EQ(step_table_width(3, 16, 262144), 1024);
  // A model whose positions end sooner: its whole context, as a power of two.
  EXPECT_EQ(step_table_width(2, 64, 4096), 64);
  EXPECT_EQ(step_table_width(2, 64, 4000), 64);
  EXPECT_EQ(step_table_width(2, 64, 0), 2);
}

}  // namespace
}  // namespace bg::testing

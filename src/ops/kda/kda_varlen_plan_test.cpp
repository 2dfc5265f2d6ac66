// kda_varlen_plan: chunk tables of ragged steps (chunk edges, 1-token and empty sequences, a custom chunk size), the
// packed device table, and the checks on malformed input.
#include "ops/kda/kda_varlen_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/error.h"

namespace bg::ops {
namespace {

TEST(KdaVarlenPlan, CutsEachSequenceIntoChunksThatNeverCrossIt) {
  // Lengths 1 (decode), 130, 0, 64, 2, 65, 1.
  const std::vector<int64_t> begin{0, 1, 131, 131, 195, 197, 262, 263};
  const std::vector<int32_t> slots{7, 3, 9, 0, 12, 5, 4};
  const KdaVarlenPlan plan = kda_varlen_plan(begin, slots);
  ASSERT_EQ(plan.n_seqs(), 4);
  EXPECT_EQ(plan.short_seqs, (std::vector<int32_t>{0, 6}));
  EXPECT_EQ(plan.n_chunked_tokens, 130 + 64 + 2 + 65);
  const std::vector<std::pair<int32_t, int32_t>> want_chunks{{1, 64},  {65, 64},  {129, 2}, {131, 64},
                                                             {195, 2}, {197, 64}, {261, 1}};
  ASSERT_EQ(plan.n_chunks(), static_cast<int64_t>(want_chunks.size()));
  for (size_t c = 0; c < want_chunks.size(); ++c) {
    EXPECT_EQ(plan.chunks[c].token_begin, want_chunks[c].first) << c;
    EXPECT_EQ(plan.chunks[c].n_tokens, want_chunks[c].second) << c;
  }
  const int32_t want_seq[4][4] = {{0, 3, 3, 1}, {3, 1, 0, 3}, {4, 1, 12, 4}, {5, 2, 5, 5}};
  for (size_t s = 0; s < 4; ++s) {
    EXPECT_EQ(plan.seqs[s].chunk_begin, want_seq[s][0]) << s;
    EXPECT_EQ(plan.seqs[s].n_chunks, want_seq[s][1]) << s;
    EXPECT_EQ(plan.seqs[s].slot, want_seq[s][2]) << s;
    EXPECT_EQ(plan.seqs[s].step_seq, want_seq[s][3]) << s;
  }
  // Every chunked token is covered exactly once, inside its own sequence.
  std::vector<int> seen(263, 0);
  for (const KdaSeqDesc& s : plan.seqs) {
    for (int32_t c = s.chunk_begin; c < s.chunk_begin + s.n_chunks; ++c) {
      const KdaChunkDesc& ch = plan.chunks[static_cast<size_t>(c)];
      EXPECT_GE(ch.token_begin, begin[static_cast<size_t>(s.step_seq)]);
      EXPECT_LE(ch.token_begin + ch.n_tokens, begin[static_cast<size_t>(s.step_seq) + 1]);
      for (int32_t t = ch.token_begin; t < ch.token_begin + ch.n_tokens; ++t) ++seen[static_cast<size_t>(t)];
    }
  }
  for (int t = 0; t < 263; ++t) EXPECT_EQ(seen[static_cast<size_t>(t)], (t == 0 || t == 262) ? 0 : 1) << t;

  const std::vector<int32_t> packed = plan.packed();
  ASSERT_EQ(packed.size(), 7u * kKdaPackedChunkInts + 4u * kKdaPackedSeqInts);
  EXPECT_EQ(packed[2], 65);              // chunk 1 token_begin
  EXPECT_EQ(packed[13], 1);              // chunk 6 n_tokens
  EXPECT_EQ(packed[14], 0);              // seq 0 chunk_begin
  EXPECT_EQ(packed[16], 3);              // seq 0 slot
  EXPECT_EQ(packed[14 + 4 * 3 + 1], 2);  // seq 3 n_chunks
}

TEST(KdaVarlenPlan, MinTokensOneAndCustomChunkSize) {
  const std::vector<int64_t> begin{0, 1, 11};
  const std::vector<int32_t> slots{0, 1};
  const KdaVarlenPlan plan = kda_varlen_plan(begin, slots, 1, 4);
  EXPECT_TRUE(plan.short_seqs.empty());
  ASSERT_EQ(plan.n_chunks(), 4);  // {0,1} | {1,4} {5,4} {9,2}
  EXPECT_EQ(plan.chunks[3].token_begin, 9);
  EXPECT_EQ(plan.chunks[3].n_tokens, 2);
  EXPECT_EQ(plan.seqs[1].chunk_begin, 1);
  EXPECT_EQ(plan.seqs[1].n_chunks, 3);
}

TEST(KdaVarlenPlan, EmptyStepAndAllDecode) {
  const std::vector<int64_t> none{0};
  EXPECT_EQ(kda_varlen_plan(none, {}).n_chunks(), 0);
  const std::vector<int64_t> begin{0, 1, 2, 3};
  const std::vector<int32_t> slots{2, 1, 0};
  const KdaVarlenPlan plan = kda_varlen_plan(begin, slots);
  EXPECT_EQ(plan.n_chunks(), 0);
  EXPECT_EQ(plan.short_seqs, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_TRUE(plan.packed().empty());
}

TEST(KdaVarlenPlan, RejectsMalformedInput) {
  const std::vector<int32_t> two{0, 1};
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{}, {}), Error);
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{1, 3, 4}, two), Error);                          // not from 0
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{0, 3, 2}, two), Error);                          // decreasing
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{0, 3}, two), Error);                             // slot count
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{0, 3, 4}, std::vector<int32_t>{0, -1}), Error);  // slot
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{0, 3, 4}, two, 0), Error);                       // min_tokens
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{0, 3, 4}, two, 2, 0), Error);                    // chunk size
  EXPECT_THROW(kda_varlen_plan(std::vector<int64_t>{0, int64_t{1} << 32, (int64_t{1} << 32) + 1}, two), Error);
}

}  // namespace
}  // namespace bg::ops

// MLA decode plan and split-KV schedule (host model of the device schedule): head groups, partition counts,
// workspace layout, and the schedule's invariants (every tile in exactly one partition, partitions non-empty and
// balanced, split tokens' pieces in distinct slots within the plan's bound) over random ragged batches, and where
// the token-aligned schedule replaces the even cut (every token whole; taken exactly when the rule says it pays).
#include "ops/mla/mla_decode_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"

namespace bg::ops {
namespace {

MlaParams decode_params(int64_t n_tokens, int64_t heads) { return {n_tokens, heads, 512, 128, 64, 128, 64, 0.1f}; }

TEST(MlaDecodePlan, HeadGroupsArePaddedToSixteenAndAtMostFortyEight) {
  struct Want {
    int64_t heads, group_heads, n_groups;
  };
  for (const Want& w : std::vector<Want>{{96, 48, 2}, {128, 48, 3}, {1, 16, 1}, {8, 16, 1}, {16, 16, 1},
                                         {32, 32, 1}, {40, 48, 1}, {48, 48, 1}, {64, 32, 2}, {80, 48, 2}}) {
    const MlaDecodePlan plan = mla_decode_plan(decode_params(4, w.heads), 132);
    EXPECT_EQ(plan.group_heads, w.group_heads) << w.heads << " heads";
    EXPECT_EQ(plan.n_groups, w.n_groups) << w.heads << " heads";
    EXPECT_GE(plan.group_heads * plan.n_groups, w.heads);
    EXPECT_EQ(plan.n_partitions, 132 / w.n_groups) << "one CTA per SM by default";
    EXPECT_EQ(plan.max_slots, 2 * plan.n_partitions);
  }
}

TEST(MlaDecodePlan, WorkspaceRegionsAreAlignedAndDisjoint) {
  const MlaDecodePlan plan = mla_decode_plan(decode_params(64, 96), 132);
  const MlaDecodeWorkspace& ws = plan.ws;
  const std::vector<std::pair<size_t, size_t>> regions = {
      {ws.q_full, 64 * 96 * 576 * 2},
      {ws.o_lat, 64 * 96 * 512 * 2},
      {ws.part_o, static_cast<size_t>(plan.max_slots * plan.n_groups * 512 * plan.group_heads * 4)},
      {ws.part_ml, static_cast<size_t>(plan.max_slots * plan.n_groups * 2 * plan.group_heads * 4)},
      {ws.meta, static_cast<size_t>(MlaDecodeMeta::count(64, plan.n_partitions) * 4)}};
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].first % 256, 0u) << "region " << i;
    EXPECT_LE(regions[i].first + regions[i].second, ws.total_bytes) << "region " << i;
    if (i + 1 < regions.size()) {
      EXPECT_LE(regions[i].first + regions[i].second, regions[i + 1].first);
    }
  }
}

TEST(MlaDecodePlan, TakesOnlyTheProductionLatentAndRejectsBadParams) {
  EXPECT_TRUE(mla_decode_takes(decode_params(1, 96)));
  MlaParams p = decode_params(1, 96);
  p.kv_lora_rank = 32;
  EXPECT_FALSE(mla_decode_takes(p));
  EXPECT_THROW(mla_decode_plan(p, 132), Error);
  p = decode_params(0, 96);
  EXPECT_THROW(mla_decode_plan(p, 132), Error);
  p = decode_params(kMlaDecodeMaxTokens + 1, 96);
  EXPECT_THROW(mla_decode_plan(p, 132), Error);
  p = decode_params(4, 96);
  p.softmax_scale = 0.0f;
  EXPECT_THROW(mla_decode_plan(p, 132), Error);
  EXPECT_THROW(mla_decode_plan(decode_params(4, 96), 0), Error);
  EXPECT_THROW(mla_decode_plan(decode_params(4, 96), 132, {MlaDecodeMma::kWgmma, 2000, 1}), Error);
  EXPECT_THROW(mla_decode_plan(decode_params(4, 96), 132, {MlaDecodeMma::kWgmma, 8, 0}), Error);
}

// The busiest partition of the token-aligned schedule, counted token by token (not from partition begins, as the
// schedule does): token t's tiles go to the partition of its middle tile under the even cut.
int64_t aligned_max_tiles(const MlaDecodeSchedule& s) {
  std::vector<int64_t> load(static_cast<size_t>(s.n_used), 0);
  for (size_t t = 0; t + 1 < s.tile_prefix.size(); ++t) {
    const int64_t tiles = s.tile_prefix[t + 1] - s.tile_prefix[t];
    const int64_t mid = s.tile_prefix[t] + (tiles - 1) / 2;
    load[static_cast<size_t>(mla_partition_of(mid, s.total_tiles, s.n_used))] += tiles;
  }
  return *std::max_element(load.begin(), load.end());
}

// The token-aligned schedule: every token whole in one partition, partitions in token order cut only at token
// boundaries (empty ones allowed), nothing to merge.
void check_aligned(const MlaDecodePlan& plan, const MlaDecodeSchedule& s) {
  const auto n = static_cast<int64_t>(s.n_splits.size());
  ASSERT_EQ(s.partition_begin.size(), static_cast<size_t>(plan.n_partitions + 1));
  ASSERT_EQ(s.partition_begin.front(), 0);
  for (int64_t g = s.n_used; g <= plan.n_partitions; ++g) ASSERT_EQ(s.partition_begin[g], s.total_tiles) << g;
  for (int64_t g = 0; g < plan.n_partitions; ++g) ASSERT_LE(s.partition_begin[g], s.partition_begin[g + 1]) << g;
  for (int64_t g = 0; g <= plan.n_partitions; ++g) {
    ASSERT_TRUE(std::binary_search(s.tile_prefix.begin(), s.tile_prefix.end(), s.partition_begin[g]))
        << "partition " << g << " begins inside a token";
  }
  int64_t max_tiles = 0;
  for (int64_t t = 0; t < n; ++t) {
    const auto i = static_cast<size_t>(t);
    ASSERT_EQ(s.n_splits[i], 1) << t;
    const int32_t g = s.first_partition[i];
    ASSERT_GE(g, 0);
    ASSERT_LT(g, s.n_used);
    EXPECT_LE(s.partition_begin[g], s.tile_prefix[i]) << "token " << t;
    EXPECT_GE(s.partition_begin[g + 1], s.tile_prefix[i + 1]) << "token " << t;
    max_tiles = std::max<int64_t>(max_tiles, s.partition_begin[g + 1] - s.partition_begin[g]);
  }
  EXPECT_EQ(max_tiles, aligned_max_tiles(s));
}

// Every invariant the kernels rely on, for one batch of positions.
void check_schedule(const MlaDecodePlan& plan, const std::vector<int64_t>& positions) {
  const MlaDecodeSchedule s = mla_decode_schedule_cpu(plan, positions.data());
  const auto n = static_cast<int64_t>(positions.size());
  // The even cut of the same batch decides whether the aligned schedule was due.
  MlaDecodePlan even_plan = plan;
  even_plan.align_tokens = false;
  const MlaDecodeSchedule even = mla_decode_schedule_cpu(even_plan, positions.data());
  ASSERT_FALSE(even.aligned);
  const auto n_split_even = std::count_if(even.n_splits.begin(), even.n_splits.end(), [](int32_t k) { return k > 1; });
  const int64_t max_even = (even.total_tiles + even.n_used - 1) / even.n_used;
  const bool pays = n_split_even > 0 && (aligned_max_tiles(even) - max_even) * kMlaAlignSplitsPerTile <= n_split_even;
  ASSERT_EQ(s.aligned, plan.align_tokens && pays);
  ASSERT_EQ(s.tile_prefix, even.tile_prefix);
  ASSERT_EQ(s.n_used, even.n_used);
  if (s.aligned) {
    check_aligned(plan, s);
    return;
  }
  ASSERT_EQ(s.tile_prefix.front(), 0);
  ASSERT_EQ(s.tile_prefix.back(), s.total_tiles);
  ASSERT_GE(s.n_used, 1);
  ASSERT_LE(s.n_used, plan.n_partitions);
  ASSERT_LE(s.n_used, s.total_tiles) << "a partition would be empty";
  // Partitions tile [0, total) without gaps, non-empty and balanced (sizes differ by at most one tile).
  int64_t lo = INT64_MAX, hi = 0;
  for (int64_t g = 0; g < s.n_used; ++g) {
    const int64_t size =
        mla_partition_begin(g + 1, s.total_tiles, s.n_used) - mla_partition_begin(g, s.total_tiles, s.n_used);
    ASSERT_GE(size, 1);
    lo = std::min(lo, size);
    hi = std::max(hi, size);
    for (int64_t x = mla_partition_begin(g, s.total_tiles, s.n_used);
         x < mla_partition_begin(g + 1, s.total_tiles, s.n_used); ++x) {
      ASSERT_EQ(mla_partition_of(x, s.total_tiles, s.n_used), g) << "tile " << x;
    }
  }
  EXPECT_LE(hi - lo, 1) << "partitions differ by more than one tile";
  ASSERT_EQ(s.partition_begin.size(), static_cast<size_t>(plan.n_partitions + 1));
  for (int64_t g = 0; g <= plan.n_partitions; ++g) {
    ASSERT_EQ(s.partition_begin[g], g < s.n_used ? mla_partition_begin(g, s.total_tiles, s.n_used) : s.total_tiles);
  }
  // Split tokens: pieces in consecutive partitions, their slots disjoint and inside the plan's bound.
  std::set<int64_t> slots;
  for (int64_t t = 0; t < n; ++t) {
    const auto i = static_cast<size_t>(t);
    ASSERT_EQ(s.tile_prefix[i + 1] - s.tile_prefix[i], mla_tiles_of_context(positions[i] + 1));
    const int64_t first = mla_partition_of(s.tile_prefix[i], s.total_tiles, s.n_used);
    const int64_t last = mla_partition_of(s.tile_prefix[i + 1] - 1, s.total_tiles, s.n_used);
    ASSERT_EQ(s.n_splits[i], last - first + 1);
    ASSERT_EQ(s.first_partition[i], first);
    if (s.n_splits[i] <= 1) continue;
    for (int64_t g = first; g <= last; ++g) {
      const int64_t slot = s.slot_base[i] + (g - first);
      ASSERT_LT(slot, plan.max_slots);
      ASSERT_TRUE(slots.insert(slot).second) << "slot " << slot << " used twice";
    }
  }
}

TEST(MlaDecodeSchedule, InvariantsOverRandomRaggedBatches) {
  std::mt19937_64 rng(5);
  int aligned = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 300);
    const int64_t max_ctx = int64_t{1} << (rng() % 17);
    std::vector<int64_t> positions(static_cast<size_t>(n));
    for (auto& p : positions) p = static_cast<int64_t>(rng() % static_cast<uint64_t>(max_ctx));
    MlaDecodeOptions o;
    o.align_tokens = iter % 4 != 1;
    o.n_partitions = iter % 3 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 300);
    o.min_tiles_per_partition = 1 + static_cast<int64_t>(rng() % 8);
    const MlaDecodePlan plan = mla_decode_plan(decode_params(n, iter % 2 ? 96 : 128), 132, o);
    SCOPED_TRACE(::testing::Message() << "iteration " << iter << ": " << n << " tokens, contexts < " << max_ctx
                                      << ", " << plan.n_partitions << " partitions, min tiles "
                                      << plan.min_tiles_per_partition);
    check_schedule(plan, positions);
    aligned += mla_decode_schedule_cpu(plan, positions.data()).aligned ? 1 : 0;
  }
  EXPECT_GT(aligned, 10) << "the random batches should reach both schedules";
  EXPECT_LT(aligned, 200);
}

TEST(MlaDecodeSchedule, EdgeCases) {
  const MlaDecodePlan plan = mla_decode_plan(decode_params(1, 96), 132);
  check_schedule(plan, {0});            // one tile: one partition, no split
  check_schedule(plan, {262143});       // 256k context: 4096 tiles over 66 partitions, one token in 66 pieces
  const MlaDecodePlan wide = mla_decode_plan(decode_params(256, 96), 132);
  check_schedule(wide, std::vector<int64_t>(256, 63));   // 256 one-tile tokens: no token split
  check_schedule(wide, std::vector<int64_t>(256, 4095));  // 64 tiles each
  std::vector<int64_t> mixed(256, 0);
  mixed[17] = 200000;
  check_schedule(wide, mixed);  // one long token among many short ones
}

// Where the aligned schedule is taken at K3's shapes on 132 SMs (66 partitions of two head groups), each case also
// through every invariant above.
TEST(MlaDecodeSchedule, WholeTokensWhereTheyBalanceAlmostAsWell) {
  auto schedule = [](int64_t batch, int64_t context, bool align = true) {
    MlaDecodeOptions o;
    o.align_tokens = align;
    const MlaDecodePlan plan = mla_decode_plan(decode_params(batch, 96), 132, o);
    const std::vector<int64_t> positions(static_cast<size_t>(batch), context - 1);
    check_schedule(plan, positions);
    return mla_decode_schedule_cpu(plan, positions.data());
  };
  // Batch 64 at 4k: the even cut (62-63 tiles) splits almost every token; one token per partition costs one tile.
  const MlaDecodeSchedule b64 = schedule(64, 4096);
  EXPECT_TRUE(b64.aligned);
  EXPECT_EQ(b64.n_used, 66);
  for (int64_t t = 0; t < 64; ++t) {
    EXPECT_EQ(b64.partition_begin[b64.first_partition[t] + 1] - b64.partition_begin[b64.first_partition[t]], 64);
  }
  EXPECT_FALSE(schedule(64, 4096, false).aligned);  // align_tokens off: the even cut
  EXPECT_TRUE(MlaDecodeOptions{}.align_tokens) << "on by default (measured faster)";
  EXPECT_TRUE(schedule(128, 4096).aligned);         // two tokens a partition: 128 tiles against 125
  // Not where whole tokens cost more than the merges they save, or where the even cut splits nothing.
  EXPECT_FALSE(schedule(256, 4096).aligned);  // four tokens a partition: 256 tiles against 249
  EXPECT_FALSE(schedule(64, 32768).aligned);  // 512 tiles against 497
  EXPECT_FALSE(schedule(16, 4096).aligned);   // 64 against 16
  EXPECT_FALSE(schedule(1, 262144).aligned);
  EXPECT_FALSE(schedule(66, 4096).aligned);  // 64 tiles a partition: the even cut is whole tokens already
  // The GPU parity cases' batches (tests/cuda/mla_decode_parity_test.cpp, MlaDecode.ScheduleMatchesHostModel).
  auto forced = [](std::vector<int64_t> positions, int64_t partitions) {
    const MlaDecodePlan plan = mla_decode_plan(decode_params(static_cast<int64_t>(positions.size()), 96), 132,
                                               {MlaDecodeMma::kWgmmaHeadsM, partitions, 1, false, true});
    check_schedule(plan, positions);
    return mla_decode_schedule_cpu(plan, positions.data());
  };
  EXPECT_FALSE(forced(std::vector<int64_t>(8, 999), 9).aligned);  // one tile more for 8 merges: not worth it
  EXPECT_TRUE(forced({39, 999, 999, 999, 999, 999, 999, 999, 999}, 8).aligned);  // the busiest as the even cut's
  const MlaDecodeSchedule two = forced({39, 999, 999, 999, 999, 999, 999, 999, 999, 999, 999}, 10);
  EXPECT_TRUE(two.aligned);
  EXPECT_EQ(two.first_partition[0], 0);
  EXPECT_EQ(two.first_partition[1], 0);
  EXPECT_EQ(two.partition_begin[1], 17);
}

TEST(MlaDecodeSchedule, PerTokenPlanSplitsNothingAndCutsOnlyAtTokens) {
  MlaDecodeOptions o;
  o.per_token = true;
  const MlaDecodePlan plan = mla_decode_plan(decode_params(5, 96), 132, o);
  EXPECT_EQ(plan.n_partitions, 5);
  EXPECT_EQ(plan.max_slots, 0);
  const std::vector<int64_t> positions = {0, 63, 64, 262143, 4095};
  const MlaDecodeSchedule s = mla_decode_schedule_cpu(plan, positions.data());
  EXPECT_EQ(s.n_used, 5);
  EXPECT_EQ(s.total_tiles, 1 + 1 + 2 + 4096 + 64);
  for (size_t t = 0; t < positions.size(); ++t) {
    EXPECT_EQ(s.n_splits[t], 1) << t;
    EXPECT_EQ(s.first_partition[t], static_cast<int32_t>(t)) << t;
  }
  EXPECT_EQ(s.partition_begin, s.tile_prefix);  // partition g = token g
  // A token's schedule does not depend on the other tokens: the same token alone gets one whole partition too.
  const MlaDecodePlan alone = mla_decode_plan(decode_params(1, 96), 132, o);
  const int64_t long_token = 262143;
  const MlaDecodeSchedule a = mla_decode_schedule_cpu(alone, &long_token);
  EXPECT_EQ(a.n_splits[0], 1);
  EXPECT_EQ(a.partition_begin, (std::vector<int32_t>{0, 4096}));
  o.n_partitions = 8;
  EXPECT_THROW(mla_decode_plan(decode_params(5, 96), 132, o), Error);
}

}  // namespace
}  // namespace bg::ops

// kv::StateManager over the fake model (its running hash lives in the KV entries and the state slot, so a wrong block,
// a wrong snapshot or a corrupted copy changes the logits or trips the fake's slot-vs-KV check): the one reservation
// site, reference-counted sharing of cached blocks (copy-on-write of a partly used block), KDA snapshots at the
// interval, LRU eviction under pressure (dropped, or kept in the host tier), reference counts after an abort, a request
// arriving while its prefix is being offloaded, offload / restore of a sequence, compressed state.
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "sched/fake_model.h"

namespace bg::kv {
namespace {

using bg::testing::FakeModelOptions;
using bg::testing::FakeSetup;

std::vector<int32_t> tokens(int n, int32_t first = 1) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (first + 7 * i) % 60;
  return v;
}

// Runs tokens [seq.n_past(), end) through the fake in pieces of at most `piece` tokens (ending at multiples of it),
// committing to the cache after each as the scheduler does; returns the last row's logits.
std::vector<float> run(FakeSetup& f, Sequence& seq, const std::vector<int32_t>& all, int64_t end, int64_t piece = 8) {
  const int64_t V = f.model.info().vocab_size;
  std::vector<float> logits;
  f.state.reserve(seq, end);
  while (seq.n_past() < end) {
    const int64_t start = seq.n_past(), stop = std::min(end, (start / piece + 1) * piece);
    logits.assign(static_cast<size_t>((stop - start) * V), 0.0f);
    f.model.forward(seq, std::span<const int32_t>(all).subspan(static_cast<size_t>(start),
                                                               static_cast<size_t>(stop - start)), logits.data());
    f.state.commit(seq, all, static_cast<int64_t>(all.size()));
  }
  return std::vector<float>(logits.end() - V, logits.end());
}

// The logits after `all` computed from scratch without any cache.
std::vector<float> reference(const FakeModelOptions& o, const std::vector<int32_t>& all) {
  FakeModelOptions plain = o;
  plain.prefix_cache = false;
  plain.host_bytes = 0;
  plain.n_blocks = 256;
  FakeSetup f(plain);
  auto seq = f.state.new_sequence();
  return run(f, *seq, all, static_cast<int64_t>(all.size()));
}

void expect_accounted(const FakeSetup& f) {
  const StateUsage u = f.state.usage();
  EXPECT_GE(u.kv_blocks_free + u.kv_blocks_cached, 0);
  EXPECT_LE(u.kv_blocks_free + u.kv_blocks_cached, u.kv_blocks_total);
}

TEST(StateManager, ReservesInOnePlaceAndReleasesEverything) {
  FakeSetup f(FakeModelOptions{.n_blocks = 8, .n_slots = 2});
  auto a = f.state.new_sequence(9);  // 3 blocks of 4
  EXPECT_EQ(a->kv_blocks().size(), 3u);
  EXPECT_EQ(f.state.blocks_to_reserve(*a, 12), 0);
  EXPECT_EQ(f.state.blocks_to_reserve(*a, 13), 1);
  auto b = f.state.new_sequence();
  EXPECT_FALSE(f.state.try_reserve(*b, 24));  // 6 more blocks, 5 free: nothing taken
  EXPECT_TRUE(b->kv_blocks().empty());
  EXPECT_THROW(f.state.reserve(*b, 24), Error);
  EXPECT_THROW(f.state.new_sequence(), Error);  // both slots in use
  a.reset();
  b.reset();
  const StateUsage u = f.state.usage();
  EXPECT_EQ(u.kv_blocks_free, 8);
  EXPECT_EQ(u.state_slots_free, 2);
  EXPECT_EQ(f.state.n_sequences(), 0);
}

// --deterministic without KDA layers: a hit resumes on the scheduler's grid (here 4), where an uncached prefill
// would also have cut, so both compute the rest the same way.
TEST(StateManager, ResumeAlignmentRoundsAHitDown) {
  const FakeModelOptions o{.n_blocks = 32, .prefix_cache = true, .with_state = false, .resume_align = 4};
  FakeSetup f(o);
  const auto first = tokens(10);
  auto a = f.state.start_sequence(first);
  run(f, *a, first, 10);
  a.reset();
  auto longer = first;
  for (int32_t t : tokens(6, 30)) longer.push_back(t);
  EXPECT_EQ(f.state.plan_start(longer).resume_tokens, 8);  // 10 cached tokens, rounded down to the grid
  auto b = f.state.start_sequence(longer);
  EXPECT_EQ(b->n_past(), 8);
  EXPECT_EQ(run(f, *b, longer, 16), reference(o, longer));
}

// Without KDA layers (DeepSeek-V3): whole blocks are shared, a partly used last block is copied.
TEST(StateManager, SharesCachedBlocksAndCopiesAPartlyUsedOne) {
  const FakeModelOptions o{.n_blocks = 32, .prefix_cache = true, .with_state = false};
  FakeSetup f(o);
  const auto first = tokens(10);
  auto a = f.state.start_sequence(first);
  run(f, *a, first, 10);
  const std::vector<int32_t> a_blocks = a->kv_blocks();
  a.reset();
  EXPECT_EQ(f.state.usage().kv_blocks_cached, 3);  // two whole blocks and the partial one [8, 10)
  auto longer = first;
  for (int32_t t : tokens(6, 30)) longer.push_back(t);
  const StartPlan plan = f.state.plan_start(longer);
  EXPECT_EQ(plan.resume_tokens, 10);
  EXPECT_EQ(plan.blocks_pinned, 2);  // the copied block is not pinned
  auto b = f.state.start_sequence(longer);
  EXPECT_EQ(b->n_past(), 10);
  EXPECT_EQ(b->n_cached(), 10);
  ASSERT_GE(b->kv_blocks().size(), 3u);
  EXPECT_EQ(b->kv_blocks()[0], a_blocks[0]);
  EXPECT_EQ(b->kv_blocks()[1], a_blocks[1]);
  EXPECT_NE(b->kv_blocks()[2], a_blocks[2]);  // copy-on-write
  EXPECT_EQ(f.state.kv_pool().refcount(a_blocks[0]), 2);
  EXPECT_EQ(run(f, *b, longer, 16), reference(o, longer));
  // The whole prompt cached: the last token is still computed (its logits are needed).
  auto c = f.state.start_sequence(std::span<const int32_t>(longer).subspan(0, 16));
  EXPECT_EQ(c->n_past(), 15);
}

// With KDA layers: the state is taken from the deepest snapshot (every 8 tokens here), never from mid-chunk.
TEST(StateManager, ResumesFromTheDeepestSnapshot) {
  const FakeModelOptions o{.n_blocks = 32, .prefix_cache = true, .snapshot_interval = 8};
  FakeSetup f(o);
  const auto first = tokens(21);
  auto a = f.state.start_sequence(first);
  run(f, *a, first, 21);
  EXPECT_EQ(f.state.usage().state_slots_cached, 2);  // snapshots at 8 and 16
  a.reset();
  auto second = first;
  second.resize(19);
  second.push_back(55);  // shares 19 tokens: resumes at 16
  auto b = f.state.start_sequence(second);
  EXPECT_EQ(b->n_past(), 16);
  EXPECT_EQ(run(f, *b, second, 20), reference(o, second));  // the fake checks the slot against the KV at 16
  auto short_one = std::vector<int32_t>(first.begin(), first.begin() + 8);
  auto c = f.state.start_sequence(short_one);  // 8 tokens cached, but the last one must run: no snapshot fits
  EXPECT_EQ(c->n_past(), 0);
}

TEST(StateManager, EvictsTheLeastRecentlyUsedUnderPressure) {
  const FakeModelOptions o{.n_blocks = 8, .prefix_cache = true, .with_state = false};
  FakeSetup f(o);
  const auto x = tokens(8, 1), y = tokens(8, 2), z = tokens(8, 3);
  for (const auto* t : {&x, &y}) {
    auto s = f.state.start_sequence(*t);
    run(f, *s, *t, 8);
  }
  EXPECT_EQ(f.state.usage().kv_blocks_cached, 4);
  f.state.start_sequence(x).reset();  // x is used again: y is now the oldest
  auto big = f.state.start_sequence(tokens(24, 5));  // 6 blocks: 4 free + 2 evicted
  EXPECT_EQ(f.state.usage().kv_blocks_free, 0);
  EXPECT_EQ(f.state.plan_start(y).resume_tokens, 0);  // y's blocks were dropped
  EXPECT_EQ(f.state.plan_start(x).resume_tokens, 7);
  EXPECT_GE(f.state.usage().cache_evictions, 2);
  EXPECT_FALSE(f.state.try_reserve(*big, 40));  // x is all that is left to evict, and it is not enough
  (void)z;
  expect_accounted(f);
}

TEST(StateManager, HostTierKeepsEvictedPrefixesAndBringsThemBack) {
  FakeModelOptions o{.n_blocks = 8, .prefix_cache = true, .snapshot_interval = 8};
  o.host_bytes = 64 * 32 + 16 * 40;  // 64 pages of one 32-byte block (a 40-byte slot takes 2)
  FakeSetup f(o);
  const auto x = tokens(17, 1);
  {
    auto s = f.state.start_sequence(x);
    run(f, *s, x, 17);
  }
  EXPECT_EQ(f.state.usage().kv_blocks_cached, 4);  // blocks up to the snapshot at 16
  auto big = f.state.start_sequence(tokens(32, 9));  // takes all 8 blocks: x's go to the host tier
  const StateUsage u = f.state.usage();
  EXPECT_EQ(u.kv_blocks_cached, 0);
  EXPECT_EQ(u.host_kv_bytes, 4 * 32);
  EXPECT_EQ(f.state.plan_start(x).resume_tokens, 16);
  big.reset();
  auto again = f.state.start_sequence(x);
  EXPECT_EQ(again->n_past(), 16);
  EXPECT_EQ(run(f, *again, x, 17), reference(o, x));
}

TEST(StateManager, ReferenceCountsAfterAnAbort) {
  const FakeModelOptions o{.n_blocks = 16, .prefix_cache = true, .with_state = false};
  FakeSetup f(o);
  const auto x = tokens(12);
  {
    auto s = f.state.start_sequence(x);
    run(f, *s, x, 12);
  }
  auto longer = x;
  for (int32_t t : tokens(20, 4)) longer.push_back(t);
  auto b = f.state.start_sequence(longer);  // shares 2 blocks, copies none (12 is block-aligned), reserves 6 more
  f.model.forward(*b, std::span<const int32_t>(longer).subspan(12, 5), std::vector<float>(5 * 64).data());
  f.state.commit(*b, longer, 32);
  b.reset();  // aborted mid-prefill
  const StateUsage u = f.state.usage();
  EXPECT_EQ(u.kv_blocks_free + u.kv_blocks_cached, 16);  // nothing leaked, nothing freed twice
  for (int32_t blk = 0; blk < 16; ++blk) EXPECT_LE(f.state.kv_pool().refcount(blk), 1) << blk;
  EXPECT_EQ(f.state.n_sequences(), 0);
}

TEST(StateManager, ARequestArrivingWhileItsPrefixIsBeingOffloaded) {
  FakeModelOptions o{.n_blocks = 6, .prefix_cache = true, .with_state = false};
  o.host_bytes = 16 * 32;
  FakeSetup f(o);
  const auto x = tokens(9);
  {
    auto s = f.state.start_sequence(x);
    run(f, *s, x, 9);
  }
  // Taking every block offloads x's cache entries: the copies are issued, and the GPU blocks are handed out again at
  // once (their next writer waits for the copies on the device).
  auto big = f.state.new_sequence(24);
  EXPECT_EQ(f.state.usage().host_kv_bytes, 3 * 32);
  big.reset();
  // Before anything else ran, a request with that prefix: it starts from the host copies (queued behind the
  // offloading copies on the copy stream).
  auto longer = x;
  longer.push_back(44);
  auto b = f.state.start_sequence(longer);
  EXPECT_EQ(b->n_past(), 9);
  EXPECT_EQ(run(f, *b, longer, 10), reference(o, longer));
}

TEST(StateManager, OffloadAndRestoreASequenceExactly) {
  FakeModelOptions o{.n_blocks = 8, .n_slots = 1};
  o.host_bytes = 32 * 32;
  FakeSetup f(o);
  const auto x = tokens(14);
  auto a = f.state.new_sequence();
  run(f, *a, x, 10);
  ASSERT_TRUE(f.state.offload(*a));
  EXPECT_EQ(a->residency(), Residency::kHost);
  EXPECT_EQ(f.state.usage().seqs_offloaded, 1);
  EXPECT_EQ(f.state.usage().kv_blocks_free, 8);
  {  // another sequence overwrites the GPU blocks and the only slot
    auto other = f.state.new_sequence();
    run(f, *other, tokens(30, 3), 30);
  }
  f.state.restore(*a);
  EXPECT_EQ(a->residency(), Residency::kGpu);
  EXPECT_EQ(a->n_past(), 10);
  EXPECT_EQ(run(f, *a, x, 14), reference(o, x));
  a.reset();
  EXPECT_EQ(f.state.usage().host_kv_bytes + f.state.usage().host_state_bytes, 0);
}

TEST(StateManager, OffloadFailsCleanlyWithoutRoom) {
  FakeModelOptions o{.n_blocks = 8};
  o.host_bytes = 2 * 32;  // two pages: a 3-block sequence and its slot do not fit
  FakeSetup f(o);
  auto a = f.state.new_sequence();
  run(f, *a, tokens(10), 10);
  EXPECT_FALSE(f.state.offload(*a));
  EXPECT_EQ(a->residency(), Residency::kGpu);
  EXPECT_EQ(a->kv_blocks().size(), 3u);
}

}  // namespace
}  // namespace bg::kv

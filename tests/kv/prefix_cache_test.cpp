// The prefix cache's radix tree: matching whole blocks then part of one more, partial leaves covered and superseded,
// LRU touch up the path, removal of leaves only.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/error.h"
#include "kv/prefix_cache.h"

namespace bg::kv {
namespace {

std::vector<int32_t> iota(int n, int32_t first = 1) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

std::span<const int32_t> part(const std::vector<int32_t>& v, size_t begin, size_t n) {
  return std::span<const int32_t>(v).subspan(begin, n);
}

TEST(PrefixCache, MatchesWholeBlocksThenPartOfOne) {
  PrefixCache c(4);
  const auto t = iota(12);
  CacheNode* a = c.add_child(nullptr, part(t, 0, 4));
  CacheNode* b = c.add_child(a, part(t, 4, 4));
  EXPECT_EQ(b->end, 8);
  EXPECT_EQ(b->parent, a);
  PrefixMatch m = c.match(t);
  ASSERT_EQ(m.path.size(), 2u);
  EXPECT_EQ(m.partial, nullptr);
  EXPECT_EQ(m.n_tokens(), 8);
  // Diverging inside the second block: one whole block, then 2 tokens of b.
  auto d = t;
  d[6] = 99;
  m = c.match(d);
  ASSERT_EQ(m.path.size(), 1u);
  EXPECT_EQ(m.partial, b);
  EXPECT_EQ(m.partial_tokens, 2);
  EXPECT_EQ(m.n_tokens(), 6);
  // A shorter query ends inside b.
  m = c.match(part(t, 0, 7));
  EXPECT_EQ(m.n_tokens(), 7);
  EXPECT_EQ(c.match(iota(5, 50)).n_tokens(), 0);
}

TEST(PrefixCache, PartialLeavesAreCoveredAndSuperseded) {
  PrefixCache c(4);
  const auto t = iota(8);
  CacheNode* a = c.add_child(nullptr, part(t, 0, 4));
  CacheNode* p = c.add_child(a, part(t, 4, 2));  // a partial leaf: tokens 4, 5 of a block
  EXPECT_EQ(c.match(t).n_tokens(), 6);
  EXPECT_EQ(c.covering_child(a, part(t, 4, 1)), p);
  EXPECT_EQ(c.covering_child(a, part(t, 4, 3)), nullptr);
  auto stale = c.partial_prefixes(a, part(t, 4, 4));
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0], p);
  c.remove(p);
  CacheNode* full = c.add_child(a, part(t, 4, 4));
  EXPECT_EQ(c.match(t).n_tokens(), 8);
  EXPECT_EQ(c.covering_child(a, part(t, 4, 2)), full);
  EXPECT_EQ(c.n_nodes(), 2);
}

TEST(PrefixCache, TouchMarksThePathAndRemoveTakesLeavesOnly) {
  PrefixCache c(2);
  const auto t = iota(6);
  CacheNode* a = c.add_child(nullptr, part(t, 0, 2));
  CacheNode* b = c.add_child(a, part(t, 2, 2));
  CacheNode* other = c.add_child(nullptr, part(iota(2, 40), 0, 2));
  c.touch(b);
  EXPECT_EQ(a->last_use, b->last_use);
  EXPECT_GT(a->last_use, other->last_use);
  EXPECT_THROW(c.remove(a), Error);  // has a child
  a->gpu_block = 3;
  c.remove(b);
  EXPECT_THROW(c.remove(a), Error);  // still holds a block
  a->gpu_block = -1;
  c.remove(a);
  EXPECT_EQ(c.n_nodes(), 1);
  EXPECT_THROW(c.add_child(nullptr, part(iota(2, 40), 0, 2)), Error);  // twice
  EXPECT_THROW(c.add_child(nullptr, part(t, 0, 3)), Error);            // longer than a block
}

}  // namespace
}  // namespace bg::kv

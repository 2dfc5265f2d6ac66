// Linear groups (model/backend_weights.h): place_linear_groups puts each complete group's linears side by side in a
// layer's batch, in the group's order, and leaves incomplete or overlapping groups apart; GroupProjections gives the
// same outputs as the parts' own linears on a backend that does not fuse (the CPU).
#include <gtest/gtest.h>

#include <vector>

#include "backend/backend.h"
#include "model/arch_table.h"
#include "model/backend_weights.h"
#include "model/forward_common.h"
#include "ops/linear/linear.h"

namespace bg {
namespace {

std::vector<uint64_t> keys_of(const std::vector<int>& ids, int64_t layer) {
  std::vector<uint64_t> k;
  for (int id : ids) k.push_back(ModelWeights::key(id, layer, -1));
  return k;
}

TEST(LinearGroups, PlacedSideBySideInTheGroupsOrder) {
  std::vector<uint64_t> keys = keys_of({1, 2, 3, 4, 5, 6, 7}, 3);
  const std::vector<std::vector<int>> groups = {{6, 2, 4}, {7, 1}};
  const std::vector<GroupRun> runs = place_linear_groups(3, keys, groups);
  // 1 is the first member of {7, 1}, 2 the first of {6, 2, 4}: each group lands where its first member was.
  EXPECT_EQ(keys, keys_of({7, 1, 6, 2, 4, 3, 5}, 3));
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].run.first, 0u);
  EXPECT_EQ(runs[0].run.count, 2u);
  EXPECT_EQ(runs[0].group, 1u);
  EXPECT_EQ(runs[1].run.first, 2u);
  EXPECT_EQ(runs[1].run.count, 3u);
  EXPECT_EQ(runs[1].group, 0u);
}

TEST(LinearGroups, IncompleteOverlappingOrRepeatingGroupsStayApart) {
  std::vector<uint64_t> keys = keys_of({1, 2, 3, 4}, 0);
  const std::vector<std::vector<int>> groups = {
      {1, 9},     // 9 is not in this layer
      {2, 3},     // complete
      {3, 4},     // 3 already belongs to {2, 3}
      {4, 4},     // one linear twice
      {1},        // a group of one is no group
      {1, 4},     // complete: 1 and 4 are still free
  };
  const std::vector<GroupRun> runs = place_linear_groups(0, keys, groups);
  EXPECT_EQ(keys, keys_of({1, 4, 2, 3}, 0));
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].group, 5u);
  EXPECT_EQ(runs[0].run.first, 0u);
  EXPECT_EQ(runs[1].group, 1u);
  EXPECT_EQ(runs[1].run.first, 2u);
  // Another layer's keys are not this layer's linears.
  std::vector<uint64_t> other = keys_of({2, 3}, 1);
  EXPECT_TRUE(place_linear_groups(0, other, groups).empty());
  EXPECT_EQ(other, keys_of({2, 3}, 1));
}

TEST(LinearGroups, ProjectionsEqualThePartsWithoutFusion) {
  std::unique_ptr<Backend> be = make_backend("cpu");
  std::vector<std::vector<float>> w = {std::vector<float>(3 * 4), std::vector<float>(2 * 4)};
  for (size_t p = 0; p < w.size(); ++p) {
    for (size_t i = 0; i < w[p].size(); ++i) w[p][i] = 0.25f * static_cast<float>(i + 1) - static_cast<float>(p);
  }
  std::vector<HostTensor> stored;
  std::vector<QuantWeight> q;
  for (size_t p = 0; p < w.size(); ++p) {
    const int64_t rows = static_cast<int64_t>(w[p].size() / 4);
    stored.push_back(HostTensor::from_f32(w[p], {rows, 4}));
  }
  for (size_t p = 0; p < w.size(); ++p) {
    q.push_back({WeightFormat::kDense, stored[p].shape()[0], 4, stored[p].view("w"), {}, "w", {}});
  }
  std::vector<std::unique_ptr<LinearHandle>> h;
  LinearGroup g;
  for (const QuantWeight& qw : q) {
    h.push_back(be->prepare_linear(qw));
    g.parts.push_back(h.back().get());
  }
  EXPECT_FALSE(be->linear_group_fuses(g, 1));
  const std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f, 0.0f, 1.0f, 1.0f, -1.0f};
  const GroupProjections in(*be, g, be->upload_f32(x, {2, 4}, DType::kF32));
  ASSERT_EQ(in.size(), 2u);
  for (size_t p = 0; p < q.size(); ++p) {
    const Tensor y = in[p];
    std::vector<float> got(static_cast<size_t>(y.numel())), ref(got.size());
    be->download_f32(y, got.data());
    ops::linear_cpu(q[p], x.data(), 2, ref.data());
    EXPECT_EQ(got, ref) << "part " << p;
  }
}

}  // namespace
}  // namespace bg

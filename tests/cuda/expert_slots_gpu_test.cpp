// The CUDA backend's expert slots keep the W4A16 decode layout (a second copy of the layer's MXFP4 experts) only when
// every expert has a slot here: on an expert-parallel rank the rows come through the exchange and run the per-slot
// kernels, so the layout would double the experts' memory for nothing. Skipped without a GPU.
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_moe.h"
#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "moe/expert_table.h"

namespace bg::testing {
namespace {

TEST(CudaExpertSlots, OnlyARankWithEveryExpertKeepsTheDecodeLayout) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  constexpr int64_t kExperts = 4, kHidden = 64, kInter = 96;
  std::deque<HostWeight> host;  // the handles' host views point into these
  std::vector<std::unique_ptr<LinearHandle>> owned;
  ExpertWeights all;
  auto make = [&](int64_t n_out, int64_t n_in, uint64_t seed) {
    host.push_back(random_weight(WeightFormat::kMxfp4, n_out, n_in, 0.1f, seed));
    owned.push_back(be->prepare_linear(host.back().w));
    return owned.back().get();
  };
  for (int64_t e = 0; e < kExperts; ++e) {
    all.gate.push_back(make(kInter, kHidden, static_cast<uint64_t>(3 * e)));
    all.up.push_back(make(kInter, kHidden, static_cast<uint64_t>(3 * e + 1)));
    all.down.push_back(make(kHidden, kInter, static_cast<uint64_t>(3 * e + 2)));
  }
  const moe::ExpertTable one(*be, moe::ExpertPlacement::contiguous(kExperts, 1, 0), all);
  EXPECT_TRUE(one.all_local());
  EXPECT_NE(dynamic_cast<const cuda::CudaExpertSlots&>(one.slots()).w4a16(), nullptr);

  // Rank 0 of two: experts 0 and 1 here, 2 and 3 on the other rank.
  ExpertWeights half = all;
  for (size_t e = 2; e < 4; ++e) half.gate[e] = half.up[e] = half.down[e] = nullptr;
  const moe::ExpertTable ep(*be, moe::ExpertPlacement::contiguous(kExperts, 2, 0), half);
  EXPECT_FALSE(ep.all_local());
  EXPECT_EQ(ep.n_slots(), 2);
  EXPECT_EQ(dynamic_cast<const cuda::CudaExpertSlots&>(ep.slots()).w4a16(), nullptr);
}

}  // namespace
}  // namespace bg::testing

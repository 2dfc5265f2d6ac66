// route_topk_cuda against route_topk_cpu on the same fp32 logits and bias: DeepSeek-V3 (256 experts, 8 groups keep 4,
// top-8), Kimi-K3 (896 experts, top-16), negative biases (the 0.0 mask of losing groups is selected), no
// renormalisation, and top-32. Ids must match exactly: tokens whose decisive gaps are below 1e-5 (near-ties, where
// expf and std::exp may round differently by an ulp) are redrawn. Weights within 1e-5 relative (fp32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "ops/router/router.h"
#include "ops/router/router_cuda.h"

namespace bg::ops {
namespace {

// True if a decision of route_topk_cpu for this token hinges on a gap below 1e-5: the group boundary (topk_group-th vs
// next group score) or any adjacent pair among the first top_k + 1 biased scores after masking (order matters), except
// exact ties of masked 0.0 values, which both sides break by index.
bool has_near_tie(const RouterParams& p, const float* logits, const float* bias) {
  constexpr float kGap = 1e-5f;
  const int64_t E = p.n_experts, per_group = E / p.n_group;
  std::vector<float> c(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) c[static_cast<size_t>(e)] = 1.0f / (1.0f + std::exp(-logits[e])) + bias[e];
  if (p.n_group > 1 && p.topk_group < p.n_group) {
    std::vector<std::pair<float, int64_t>> g;
    for (int64_t j = 0; j < p.n_group; ++j) {
      std::vector<float> v(c.begin() + j * per_group, c.begin() + (j + 1) * per_group);
      std::sort(v.rbegin(), v.rend());
      g.push_back({per_group >= 2 ? v[0] + v[1] : v[0], j});
    }
    std::stable_sort(g.begin(), g.end(), [](auto& a, auto& b) { return a.first > b.first; });
    if (g[static_cast<size_t>(p.topk_group - 1)].first - g[static_cast<size_t>(p.topk_group)].first < kGap) {
      return true;
    }
    for (size_t r = static_cast<size_t>(p.topk_group); r < g.size(); ++r)
      std::fill(c.begin() + g[r].second * per_group, c.begin() + (g[r].second + 1) * per_group, 0.0f);
  }
  std::vector<float> sorted = c;
  std::sort(sorted.rbegin(), sorted.rend());
  for (int64_t k = 0; k < std::min(p.top_k, E - 1); ++k) {
    const float a = sorted[static_cast<size_t>(k)], b = sorted[static_cast<size_t>(k + 1)];
    if (a == 0.0f && b == 0.0f) continue;
    if (a - b < kGap) return true;
  }
  return false;
}

struct RouterCase {
  const char* name;
  RouterParams p;  // n_tokens is set per run
  float bias_scale;
  float bias_offset;
};

void run_case(const RouterCase& rc, int64_t n, uint64_t seed) {
  RouterParams p = rc.p;
  p.n_tokens = n;
  const int64_t E = p.n_experts, k = p.top_k;
  std::vector<float> bias(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    bias[static_cast<size_t>(e)] = rc.bias_offset + testing::hash_uniform(seed, static_cast<uint64_t>(e),
                                                                          rc.bias_scale);
  std::vector<float> logits(static_cast<size_t>(n * E));
  int redrawn = 0;
  for (int64_t t = 0; t < n; ++t) {
    float* row = logits.data() + t * E;
    for (uint64_t attempt = 0;; ++attempt) {
      for (int64_t e = 0; e < E; ++e)
        row[e] = testing::hash_uniform(seed + 1000 * attempt + 1, static_cast<uint64_t>(t * E + e), 4.0f);
      if (!has_near_tie(p, row, bias.data())) break;
      ++redrawn;
    }
  }
  std::vector<int32_t> ref_ids(static_cast<size_t>(n * k));
  std::vector<float> ref_w(ref_ids.size());
  route_topk_cpu(p, logits.data(), bias.data(), ref_ids.data(), ref_w.data());

  cuda::DeviceBuffer d_logits = cuda::upload(logits), d_bias = cuda::upload(bias);
  // Both ways of taking the top-k give the CPU's ids in its order.
  for (const RouterTopk algo : {RouterTopk::kRounds, RouterTopk::kSort}) {
    cuda::DeviceBuffer d_ids(ref_ids.size() * sizeof(int32_t)), d_w(ref_w.size() * sizeof(float));
    d_ids.fill_bytes(0xff);
    d_w.fill_bytes(0xff);
    route_topk_cuda(p, d_logits.as<float>(), d_bias.as<float>(), d_ids.as<int32_t>(), d_w.as<float>(), nullptr, algo);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> ids = cuda::download<int32_t>(d_ids, ref_ids.size());
    const std::vector<float> w = cuda::download<float>(d_w, ref_w.size());
    const std::string what = fmt::format("{} n={} ({} near-tie tokens redrawn), {}", rc.name, n, redrawn,
                                         algo == RouterTopk::kSort ? "sort" : "rounds");
    EXPECT_EQ(ids, ref_ids) << what;
    testing::expect_parity(w, ref_w, testing::kTolF32, what);
  }
}

const std::vector<int64_t> kTokenCounts = {0, 1, 3, 16, 100, 1000};

TEST(RouterCudaParity, TopkChoiceFromTheEnvironment) {
  EXPECT_EQ(router_topk_from_env(nullptr), RouterTopk::kSort);
  EXPECT_EQ(router_topk_from_env(""), RouterTopk::kSort);
  EXPECT_EQ(router_topk_from_env("rounds"), RouterTopk::kRounds);
  EXPECT_EQ(router_topk_from_env("sort"), RouterTopk::kSort);
  EXPECT_THROW(router_topk_from_env("bitonic"), Error);
}

TEST(RouterCudaParity, DeepSeekV3Grouped) {
  BG_REQUIRE_GPU();
  const RouterCase rc{"deepseek-v3 E=256 k=8 groups 8/4", {0, 256, 8, 8, 4, true, 2.5f}, 0.5f, 0.0f};
  for (int64_t n : kTokenCounts) run_case(rc, n, 100 + static_cast<uint64_t>(n));
}

TEST(RouterCudaParity, KimiK3Flat) {
  BG_REQUIRE_GPU();
  const RouterCase rc{"kimi-k3 E=896 k=16", {0, 896, 16, 1, 1, true, 2.827f}, 0.5f, 0.0f};
  for (int64_t n : kTokenCounts) run_case(rc, n, 200 + static_cast<uint64_t>(n));
}

TEST(RouterCudaParity, NegativeBiasSelectsMaskedZeros) {
  BG_REQUIRE_GPU();
  // Biased scores mostly negative: the 0.0 of masked groups beats them, so masked experts are picked by index.
  const RouterCase rc{"negative bias E=64 k=6 groups 8/3", {0, 64, 6, 8, 3, true, 1.0f}, 0.4f, -0.9f};
  for (int64_t n : kTokenCounts) run_case(rc, n, 300 + static_cast<uint64_t>(n));
}

TEST(RouterCudaParity, NoRenormAndWideTopK) {
  BG_REQUIRE_GPU();
  run_case({"no renorm E=128 k=4 groups 4/2", {0, 128, 4, 4, 2, false, 1.0f}, 0.3f, 0.0f}, 100, 400);
  run_case({"top-32 of 1024, 32 groups keep 8", {0, 1024, 32, 32, 8, true, 1.5f}, 0.3f, 0.0f}, 100, 401);
  run_case({"groups of one E=16 k=3 groups 16/5", {0, 16, 3, 16, 5, true, 1.0f}, 0.3f, 0.0f}, 16, 402);
  // 4 warps x (2 x 1024 + 1024) floats: past the 48 KB of dynamic shared memory a launch gets by default.
  run_case({"1024 groups of one keep 512", {0, 1024, 8, 1024, 512, true, 1.0f}, 0.3f, 0.0f}, 5, 403);
}

TEST(RouterCudaParity, RejectsUnsupportedShapes) {
  BG_REQUIRE_GPU();
  EXPECT_THROW(route_topk_cuda({1, 2048, 8, 1, 1, true, 1.0f}, nullptr, nullptr, nullptr, nullptr, nullptr), Error);
  EXPECT_THROW(route_topk_cuda({1, 256, 33, 1, 1, true, 1.0f}, nullptr, nullptr, nullptr, nullptr, nullptr), Error);
  EXPECT_THROW(route_topk_cuda({1, 256, 8, 3, 1, true, 1.0f}, nullptr, nullptr, nullptr, nullptr, nullptr), Error);
}

// NaN logits never become an out-of-range index on the device either (the old kernel read ~8 GB past the row and
// poisoned the context): same ids as the CPU, NaN weights where the CPU has them, and the context stays usable.
TEST(RouterCudaParity, NanLogitsGiveValidIdsLikeTheCpu) {
  BG_REQUIRE_GPU();
  const RouterParams p{4, 896, 16, 1, 1, true, 2.827f};
  std::vector<float> logits(static_cast<size_t>(4 * 896));
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = testing::hash_uniform(77, i, 3.0f);
  for (int64_t e = 0; e < 896; ++e) logits[static_cast<size_t>(e)] = NAN;  // token 0: every score NaN
  for (int64_t e = 0; e < 896; e += 7) logits[static_cast<size_t>(896 + e)] = NAN;  // token 1: some NaN
  std::vector<float> bias(896, 0.0f);
  std::vector<int32_t> ids_cpu(64);
  std::vector<float> w_cpu(64);
  route_topk_cpu(p, logits.data(), bias.data(), ids_cpu.data(), w_cpu.data());
  cuda::DeviceBuffer d_logits = cuda::upload(logits), d_bias = cuda::upload(bias);
  for (const RouterTopk algo : {RouterTopk::kRounds, RouterTopk::kSort}) {
    cuda::DeviceBuffer d_ids(64 * sizeof(int32_t)), d_w(64 * sizeof(float));
    d_ids.fill_bytes(0xff);
    route_topk_cuda(p, d_logits.as<float>(), d_bias.as<float>(), d_ids.as<int32_t>(), d_w.as<float>(), nullptr, algo);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    const auto ids = cuda::download<int32_t>(d_ids, 64);
    const auto w = cuda::download<float>(d_w, 64);
    for (size_t i = 0; i < 64; ++i) {
      ASSERT_TRUE(ids[i] >= 0 && ids[i] < 896) << "pair " << i;
      if (i >= 32) {  // clean tokens 2, 3 route as on the CPU
        EXPECT_EQ(ids[i], ids_cpu[i]) << "pair " << i;
      }
      EXPECT_EQ(std::isnan(w[i]), std::isnan(w_cpu[i])) << "pair " << i;
    }
  }
}

}  // namespace
}  // namespace bg::ops

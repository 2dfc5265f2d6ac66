// Attention-Residual mix against a float64 reference: candidate counts 1..9, mixed scales, large scores, aliasing.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/attn_res/attn_res.h"

namespace bg::ops {
namespace {

struct MixCase {
  int64_t n_candidates, n_tokens, dim;
  float proj_scale;  // large values push the scores into the hundreds (softmax must subtract its max)
};

// out[t] = sum_i softmax_i(s)[i] V_i[t], s_i = sum_d V_i[t,d] rsqrt(mean(V_i[t]^2) + eps) n_d p_d.
std::vector<double> reference(const MixCase& c, const std::vector<float>& packed, const std::vector<float>& norm,
                              const std::vector<float>& proj, double eps) {
  std::vector<double> out(c.n_tokens * c.dim, 0.0), s(c.n_candidates);
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    double max_s = -INFINITY;
    for (int64_t i = 0; i < c.n_candidates; ++i) {
      const float* v = packed.data() + (i * c.n_tokens + t) * c.dim;
      double ss = 0.0;
      for (int64_t d = 0; d < c.dim; ++d) ss += double{v[d]} * v[d];
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(c.dim) + eps);
      s[i] = 0.0;
      for (int64_t d = 0; d < c.dim; ++d) s[i] += v[d] * r * norm[d] * proj[d];
      max_s = std::max(max_s, s[i]);
    }
    double z = 0.0;
    for (auto& e : s) z += (e = std::exp(e - max_s));
    for (int64_t i = 0; i < c.n_candidates; ++i) {
      const float* v = packed.data() + (i * c.n_tokens + t) * c.dim;
      for (int64_t d = 0; d < c.dim; ++d) out[t * c.dim + d] += s[i] / z * v[d];
    }
  }
  return out;
}

TEST(AttnRes, MatchesFloat64Reference) {
  const std::vector<MixCase> cases = {{1, 3, 16, 1.0f},   {2, 5, 64, 1.0f},     {9, 4, 7168, 1.0f},
                                      {9, 7, 128, 30.0f}, {5, 2, 1, 1.0f},      {3, 17, 256, 0.01f}};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const MixCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "n=" << c.n_candidates << " T=" << c.n_tokens << " D=" << c.dim);
    std::vector<float> packed(c.n_candidates * c.n_tokens * c.dim);
    for (int64_t i = 0; i < c.n_candidates; ++i) {
      // Candidates of very different sizes, like a small embedding and large block sums.
      const float scale = std::pow(10.0f, static_cast<float>(i % 4) - 1.0f);
      for (int64_t j = 0; j < c.n_tokens * c.dim; ++j) packed[i * c.n_tokens * c.dim + j] = scale * normal(rng);
    }
    if (c.n_candidates > 1) std::fill_n(packed.begin(), c.dim, 0.0f);  // an all-zero row: score 0, still mixed
    std::vector<float> norm(c.dim), proj(c.dim);
    for (auto& e : norm) e = 1.0f + 0.3f * normal(rng);
    for (auto& e : proj) e = c.proj_scale * normal(rng) / std::sqrt(static_cast<float>(c.dim));
    std::vector<const float*> ptrs;
    for (int64_t i = 0; i < c.n_candidates; ++i) ptrs.push_back(packed.data() + i * c.n_tokens * c.dim);

    const AttnResParams p{c.n_candidates, c.n_tokens, c.dim, 1e-5f};
    std::vector<float> out(c.n_tokens * c.dim);
    attn_res_mix_cpu(p, ptrs.data(), norm.data(), proj.data(), out.data());
    const auto ref = reference(c, packed, norm, proj, 1e-5);
    double max_diff = 0.0, max_ref = 0.0;
    for (size_t j = 0; j < out.size(); ++j) {
      max_diff = std::max(max_diff, std::abs(out[j] - ref[j]));
      max_ref = std::max(max_ref, std::abs(ref[j]));
    }
    EXPECT_LE(max_diff / max_ref, 1e-5);

    // Writing over the last candidate (the partial sum, as the engine may) gives the same result.
    std::vector<float> packed_copy = packed;
    std::vector<const float*> ptrs_copy;
    for (int64_t i = 0; i < c.n_candidates; ++i) ptrs_copy.push_back(packed_copy.data() + i * c.n_tokens * c.dim);
    float* last = packed_copy.data() + (c.n_candidates - 1) * c.n_tokens * c.dim;
    attn_res_mix_cpu(p, ptrs_copy.data(), norm.data(), proj.data(), last);
    EXPECT_TRUE(std::equal(out.begin(), out.end(), last));
  }
}

TEST(AttnRes, OneCandidateIsIdentity) {
  const std::vector<float> v = {1.0f, -2.0f, 3.0f, 0.5f, 0.0f, -7.0f};
  const std::vector<float> norm = {1.0f, 2.0f, 3.0f}, proj = {5.0f, -1.0f, 0.25f};
  const float* ptrs[] = {v.data()};
  std::vector<float> out(6);
  attn_res_mix_cpu({1, 2, 3, 1e-5f}, ptrs, norm.data(), proj.data(), out.data());
  EXPECT_EQ(out, v);
}

TEST(AttnRes, RejectsBadParams) {
  std::vector<float> b(8);
  const float* ptrs[] = {b.data(), nullptr};
  EXPECT_THROW(attn_res_mix_cpu({0, 1, 4, 1e-5f}, ptrs, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(attn_res_mix_cpu({1, -1, 4, 1e-5f}, ptrs, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(attn_res_mix_cpu({1, 1, 0, 1e-5f}, ptrs, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(attn_res_mix_cpu({1, 1, 4, 0.0f}, ptrs, b.data(), b.data(), b.data()), Error);
  EXPECT_THROW(attn_res_mix_cpu({2, 1, 4, 1e-5f}, ptrs, b.data(), b.data(), b.data()), Error);
}

}  // namespace
}  // namespace bg::ops

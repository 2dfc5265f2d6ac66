// RMSNorm against the direct double formula y = w * x / sqrt(mean(x^2) + eps), in place and out of place, with rows
// where eps dominates and rows whose squares overflow fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace bg::ops {
namespace {

std::vector<double> reference_rmsnorm(const float* x, const float* w, int64_t dim, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
  std::vector<double> y(static_cast<size_t>(dim));
  for (int64_t i = 0; i < dim; ++i) y[static_cast<size_t>(i)] = static_cast<double>(w[i]) * x[i] * inv;
  return y;
}

struct Case {
  int64_t n_rows, dim;
  float eps;
};

TEST(RmsNorm, MatchesFormulaInAndOutOfPlace) {
  const Case cases[] = {{1, 1, 1e-6f}, {5, 77, 1e-6f}, {33, 512, 1e-5f}, {3, 7168, 1e-6f}};
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Case& c : cases) {
    std::vector<float> x(static_cast<size_t>(c.n_rows * c.dim)), w(static_cast<size_t>(c.dim));
    for (size_t i = 0; i < x.size(); ++i) x[i] = normal(rng) * static_cast<float>(1 + i % 5);
    for (auto& v : w) v = 1.0f + 0.3f * normal(rng);
    std::vector<float> y(x.size(), NAN);
    const RmsNormParams p{c.n_rows, c.dim, c.eps};
    rmsnorm_cpu(p, x.data(), w.data(), y.data());
    for (int64_t r = 0; r < c.n_rows; ++r) {
      std::vector<double> want = reference_rmsnorm(x.data() + r * c.dim, w.data(), c.dim, c.eps);
      for (int64_t i = 0; i < c.dim; ++i) {
        double v = want[static_cast<size_t>(i)];
        ASSERT_NEAR(y[static_cast<size_t>(r * c.dim + i)], v, 1e-6 * std::abs(v) + 1e-30)
            << "dim " << c.dim << " row " << r << " i " << i;
      }
    }
    std::vector<float> in_place = x;
    rmsnorm_cpu(p, in_place.data(), w.data(), in_place.data());
    EXPECT_EQ(in_place, y) << "dim " << c.dim;
  }
}

TEST(RmsNorm, EpsAndExtremeRows) {
  const int64_t dim = 64;
  std::vector<float> x(static_cast<size_t>(4 * dim)), w(static_cast<size_t>(dim));
  for (int64_t i = 0; i < dim; ++i) {
    w[static_cast<size_t>(i)] = 0.5f + 0.01f * static_cast<float>(i);
    float sign = i % 2 ? -1.0f : 1.0f;
    x[static_cast<size_t>(i)] = 0.0f;                                                // row 0: zeros -> zeros
    x[static_cast<size_t>(dim + i)] = sign * 1e-4f * static_cast<float>(1 + i % 3);  // row 1: eps dominates
    x[static_cast<size_t>(2 * dim + i)] = sign * 3e20f;                              // row 2: x^2 overflows fp32
    x[static_cast<size_t>(3 * dim + i)] = sign * 2.0f;                               // row 3: |x| = rms
  }
  const float eps = 1e-6f;
  std::vector<float> y(x.size());
  rmsnorm_cpu({4, dim, eps}, x.data(), w.data(), y.data());
  for (int64_t r = 0; r < 4; ++r) {
    std::vector<double> want = reference_rmsnorm(x.data() + r * dim, w.data(), dim, eps);
    for (int64_t i = 0; i < dim; ++i) {
      double v = want[static_cast<size_t>(i)];
      EXPECT_NEAR(y[static_cast<size_t>(r * dim + i)], v, 1e-6 * std::abs(v) + 1e-30) << "row " << r << " i " << i;
    }
  }
  EXPECT_EQ(y[0], 0.0f);
  // Rows 2 and 3: every |x| equals the RMS, so y = +-w (eps negligible).
  EXPECT_NEAR(y[static_cast<size_t>(2 * dim + 1)], -w[1], 1e-6);
  EXPECT_NEAR(y[static_cast<size_t>(3 * dim + 5)], -w[5], 1e-6);
  // Row 1: mean(x^2) ~ 4.7e-8, well below eps = 1e-6, so the output is far below w.
  EXPECT_LT(std::abs(y[static_cast<size_t>(dim)]), 0.2f * w[0]);
}

TEST(RmsNorm, RejectsBadShape) {
  float x = 1.0f, w = 1.0f, y = 0.0f;
  EXPECT_THROW(rmsnorm_cpu({1, 0, 1e-6f}, &x, &w, &y), Error);
  EXPECT_THROW(rmsnorm_cpu({-1, 1, 1e-6f}, &x, &w, &y), Error);
  EXPECT_NO_THROW(rmsnorm_cpu({0, 1, 1e-6f}, &x, &w, &y));
}

}  // namespace
}  // namespace bg::ops

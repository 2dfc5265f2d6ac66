// Residual add and sigmoid gate against the direct float64 formulas, including saturated gates and aliasing; the
// column split against direct indexing and its bounds checks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/elementwise/elementwise.h"

namespace bg::ops {
namespace {

std::vector<float> random_vec(int64_t n, uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sd);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& e : x) e = normal(rng);
  return x;
}

TEST(Elementwise, AddInPlace) {
  const auto x = random_vec(300, 1, 2.0f);
  auto y = random_vec(300, 2, 5.0f);
  const auto y0 = y;
  add_inplace_cpu(300, x.data(), y.data());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], y0[i] + x[i]);
  std::vector<float> twice = x;
  add_inplace_cpu(300, twice.data(), twice.data());  // x may alias y
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(twice[i], 2.0f * x[i]);
  add_inplace_cpu(0, nullptr, nullptr);
}

TEST(Elementwise, SigmoidGateMatchesFormula) {
  auto gate = random_vec(500, 3, 4.0f);
  gate[0] = -1000.0f;  // exp overflows: the gate closes to exactly 0
  gate[1] = 1000.0f;   // fully open
  gate[2] = 0.0f;      // one half
  const auto x0 = random_vec(500, 4, 3.0f);
  std::vector<float> x = x0;
  sigmoid_gate_cpu(500, gate.data(), x.data());
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = x0[i] / (1.0 + std::exp(-static_cast<double>(gate[i])));
    EXPECT_NEAR(x[i], want, 1e-6 * std::max(1.0, std::abs(want))) << i;
  }
  EXPECT_EQ(x[0], 0.0f);
  EXPECT_EQ(x[1], x0[1]);
  EXPECT_EQ(x[2], 0.5f * x0[2]);
  std::vector<float> self = gate;  // gate may alias x: x * sigmoid(x)
  sigmoid_gate_cpu(500, self.data(), self.data());
  for (size_t i = 3; i < self.size(); ++i) EXPECT_NEAR(self[i], gate[i] / (1.0 + std::exp(-double{gate[i]})), 1e-5);
}

TEST(Elementwise, RejectsBadParams) {
  float v = 1.0f;
  EXPECT_THROW(add_inplace_cpu(-1, &v, &v), Error);
  EXPECT_THROW(add_inplace_cpu(1, nullptr, &v), Error);
  EXPECT_THROW(sigmoid_gate_cpu(-1, &v, &v), Error);
  EXPECT_THROW(sigmoid_gate_cpu(1, &v, nullptr), Error);
}

TEST(Elementwise, SplitColumns) {
  const int64_t rows = 4, cols = 11;
  const auto src = random_vec(rows * cols, 3, 1.0f);
  std::vector<float> a(static_cast<size_t>(rows * 3)), b(static_cast<size_t>(rows * 7)), c(static_cast<size_t>(rows));
  const std::vector<ColumnSlice> slices = {{0, 3, a.data()}, {4, 7, b.data()}, {3, 1, c.data()}, {11, 0, nullptr}};
  split_columns_cpu(rows, src.data(), cols, slices);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(a[static_cast<size_t>(r * 3 + j)], src[static_cast<size_t>(r * cols + j)]);
    }
    for (int64_t j = 0; j < 7; ++j) {
      EXPECT_EQ(b[static_cast<size_t>(r * 7 + j)], src[static_cast<size_t>(r * cols + 4 + j)]);
    }
    EXPECT_EQ(c[static_cast<size_t>(r)], src[static_cast<size_t>(r * cols + 3)]);
  }
  const std::vector<ColumnSlice> outside = {{8, 4, a.data()}};
  EXPECT_THROW(split_columns_cpu(rows, src.data(), cols, outside), Error);
  const std::vector<ColumnSlice> null_dst = {{0, 2, nullptr}};
  EXPECT_THROW(split_columns_cpu(rows, src.data(), cols, null_dst), Error);
  const std::vector<ColumnSlice> too_many(kMaxColumnSlices + 1, ColumnSlice{0, 1, a.data()});
  EXPECT_THROW(split_columns_cpu(rows, src.data(), cols, too_many), Error);
}

}  // namespace
}  // namespace bg::ops

// The GPU sampler's fixed-point mass (sampling_weight.h) against exp in extended precision: within 0.75 ulp in double
// (about half an ulp expected: a wrong table entry, its low part or the polynomial shows as a full ulp or more), and
// the weights rint(exp(x) * 2^44) equal to the correctly rounded ones but where the exact value is within that error
// of a half (a unit at most, rarely).
#include "ops/sampling/sampling_weight.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace bg::ops {
namespace {

long double exact_scaled(double x) { return std::exp(static_cast<long double>(x)) * std::ldexp(1.0L, 44); }

TEST(SamplingWeight, TableHoldsTheFractionalPowersOfTwo) {
  for (int j = 0; j < kExp2Steps; ++j) {
    const long double want = std::exp2(static_cast<long double>(j) / kExp2Steps);
    const long double got = static_cast<long double>(kExp2Table[j].hi) + kExp2Table[j].lo;
    EXPECT_LE(std::fabs(got - want) / want, 1e-18L) << j;
    EXPECT_LE(std::fabs(kExp2Table[j].lo), std::ldexp(std::fabs(kExp2Table[j].hi), -53)) << j;
  }
}

TEST(SamplingWeight, WithinThreeQuartersOfAnUlpOfExp) {
  std::vector<double> xs{0.0, -0.0, -1e-300, -1e-17, -0.5, -1.0, -31.5, -31.49, -31.51, -40.0, -41.0, -1000.0};
  // Every range-reduction boundary near 0 and near the clamp, and random points over [-41, 0].
  for (int k = 0; k <= 20; ++k) {
    for (const double at : {-(k + 0.5) * std::log(2.0) / kExp2Steps, -(7370 + k + 0.5) * std::log(2.0) / kExp2Steps}) {
      xs.push_back(std::nextafter(at, 0.0));
      xs.push_back(at);
      xs.push_back(std::nextafter(at, -1.0));
    }
  }
  std::mt19937_64 rng(20261204);
  std::uniform_real_distribution<double> wide(-41.0, 0.0), near(-2.0, 0.0);
  for (int i = 0; i < 1000000; ++i) xs.push_back(i % 2 ? wide(rng) : near(rng));
  double worst_ulps = 0.0;
  int64_t differ = 0, compared = 0;
  for (const double x : xs) {
    const double got = mass_exp(x, kExp2Table);
    const long double want = exact_scaled(std::fmax(x, kMassClampNats));
    const double ulp = std::nextafter(static_cast<double>(want), INFINITY) - static_cast<double>(want);
    worst_ulps = std::max(worst_ulps, static_cast<double>(std::fabs(got - want) / ulp));
    const uint64_t weight = mass_weight(x, kExp2Table);
    const auto rounded = static_cast<uint64_t>(std::nearbyint(exact_scaled(x)));
    ASSERT_LE(weight > rounded ? weight - rounded : rounded - weight, 1u) << x;
    differ += weight != rounded;
    ++compared;
    if (x < -31.5) {
      ASSERT_EQ(weight, 0u) << x;
    }
  }
  EXPECT_LT(worst_ulps, 0.75);
  EXPECT_EQ(mass_weight(0.0, kExp2Table), uint64_t{1} << 44);
  // A unit off only where the exact value is within ~0.5 ulp of a half: about 1e-4 of these points.
  EXPECT_LE(differ, compared / 1000) << differ << " of " << compared;
  std::printf("[sampling weight] %lld points: worst %.3f ulp, %lld weights a unit from the correctly rounded one\n",
              static_cast<long long>(compared), worst_ulps, static_cast<long long>(differ));
}

}  // namespace
}  // namespace bg::ops

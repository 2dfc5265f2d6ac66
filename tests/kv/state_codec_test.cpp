// The host tier's state codecs against the fp32 state: f32 exact, bf16 within 2^-8 relative, FP8 e4m3 with per-row
// scales within 2^-4 relative + 2^-10 of the row's largest magnitude (the bounds kv/state_codec.h states), on random
// rows spanning several magnitudes, zeros and a row of one huge value.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "kv/state_codec.h"

namespace bg::kv {
namespace {

std::vector<float> random_state(int64_t rows, int64_t row_floats, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 6);
  std::vector<float> x(static_cast<size_t>(rows * row_floats));
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = std::ldexp(1.0f, exponent(rng));  // rows of very different magnitude, as in a KDA state
    for (int64_t i = 0; i < row_floats; ++i) x[static_cast<size_t>(r * row_floats + i)] = normal(rng) * scale;
  }
  std::fill(x.begin(), x.begin() + row_floats, 0.0f);                        // an all-zero row
  x[static_cast<size_t>(row_floats)] = 3.0e4f;                               // a row with one outlier
  return x;
}

std::vector<float> round_trip(StateCodec codec, const std::vector<float>& x, int64_t row_floats) {
  std::vector<std::byte> enc(static_cast<size_t>(encoded_bytes(codec, static_cast<int64_t>(x.size()), row_floats)));
  encode_state(codec, x, row_floats, enc);
  std::vector<float> y(x.size(), std::nanf(""));
  decode_state(codec, enc, row_floats, y);
  return y;
}

TEST(StateCodec, F32IsExact) {
  const auto x = random_state(64, 32, 1);
  EXPECT_EQ(round_trip(StateCodec::kF32, x, 32), x);
}

TEST(StateCodec, Bf16WithinTwoToMinusEightRelative) {
  const auto x = random_state(64, 32, 2);
  const auto y = round_trip(StateCodec::kBF16, x, 32);
  double worst = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i]));
    const double err = std::fabs(static_cast<double>(y[i]) - x[i]);
    EXPECT_LE(err, std::ldexp(std::fabs(static_cast<double>(x[i])), -8)) << i;
    if (x[i] != 0.0f) worst = std::max(worst, err / std::fabs(static_cast<double>(x[i])));
  }
  EXPECT_GT(worst, 1e-4);  // it does round
  std::printf("[state codec] bf16: max relative error %.3e (bound %.3e)\n", worst, std::ldexp(1.0, -8));
}

TEST(StateCodec, Fp8WithPerRowScales) {
  const int64_t R = 32;
  const auto x = random_state(64, R, 3);
  const auto y = round_trip(StateCodec::kFP8, x, R);
  double worst_rel_to_max = 0.0;
  for (size_t r = 0; r < x.size() / R; ++r) {
    double m = 0.0;
    for (int64_t i = 0; i < R; ++i) m = std::max(m, std::fabs(static_cast<double>(x[r * R + i])));
    for (int64_t i = 0; i < R; ++i) {
      const size_t k = r * R + static_cast<size_t>(i);
      ASSERT_TRUE(std::isfinite(y[k]));
      const double err = std::fabs(static_cast<double>(y[k]) - x[k]);
      EXPECT_LE(err, std::ldexp(std::fabs(static_cast<double>(x[k])), -4) + std::ldexp(m, -10) + 1e-30) << k;
      if (m > 0) worst_rel_to_max = std::max(worst_rel_to_max, err / m);
    }
  }
  EXPECT_EQ(y[0], 0.0f);  // zero rows stay zero
  EXPECT_EQ(encoded_bytes(StateCodec::kFP8, 64 * R, R), 64 * R + 64 * 4);  // a byte per value + a scale per row
  std::printf("[state codec] fp8: max error %.3e of the row's largest magnitude\n", worst_rel_to_max);
}

TEST(StateCodec, SizesAndBadInput) {
  EXPECT_EQ(encoded_bytes(StateCodec::kF32, 128, 32), 512);
  EXPECT_EQ(encoded_bytes(StateCodec::kBF16, 128, 32), 256);
  EXPECT_THROW(encoded_bytes(StateCodec::kFP8, 100, 32), Error);  // not whole rows
  EXPECT_EQ(parse_state_codec("bf16"), StateCodec::kBF16);
  EXPECT_THROW(parse_state_codec("int4"), Error);
  std::vector<float> x(64, 1.0f);
  std::vector<std::byte> small(10);
  EXPECT_THROW(encode_state(StateCodec::kBF16, x, 32, small), Error);
}

}  // namespace
}  // namespace bg::kv

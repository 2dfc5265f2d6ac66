// dtype conversions: bf16 rounding, fp8 e4m3 decode table edges, E2M1 and E8M0.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace bg {
namespace {

TEST(DType, NamesRoundTrip) {
  for (auto d : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kU8, DType::kI32, DType::kI64}) {
    auto parsed = dtype_from_name(dtype_name(d));
    ASSERT_TRUE(parsed.has_value());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_FALSE(dtype_from_name("F4").has_value());
  EXPECT_FALSE(dtype_from_name("bogus").has_value());
  EXPECT_EQ(dtype_size_bytes(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size_bytes(DType::kI64), 8u);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, Fp8E4M3Table) {
  EXPECT_EQ(f8e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);    // e=7, m=0
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);  // max finite
  EXPECT_EQ(f8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0xff)));
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(f32_to_f8e4m3(f8e4m3_to_f32(static_cast<uint8_t>(code))) & 0x7f, code & 0x7f) << code;
  }
  EXPECT_EQ(f32_to_f8e4m3(1000.0f), 0x7e);  // saturates
}

// The fast fp8 rounding equals an exhaustive nearest-code search (ties to the even code) on many values.
TEST(DType, Fp8E4M3RoundingMatchesExhaustiveSearch) {
  auto brute = [](float v) {
    float mag = std::fabs(v);
    if (mag >= 448.0f) return static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | 0x7e);
    uint8_t best = 0;
    float best_err = INFINITY;
    for (uint8_t code = 0; code <= 0x7e; ++code) {
      float err = std::fabs(f8e4m3_to_f32(code) - mag);
      if (err < best_err || (err == best_err && (code & 1) == 0)) {
        best = code;
        best_err = err;
      }
    }
    return static_cast<uint8_t>((std::signbit(v) ? 0x80 : 0) | best);
  };
  std::vector<float> values;
  for (int code = 0; code < 0x7e; ++code) {  // every code and every midpoint between neighbours
    float a = f8e4m3_to_f32(static_cast<uint8_t>(code)), b = f8e4m3_to_f32(static_cast<uint8_t>(code + 1));
    values.insert(values.end(), {a, -a, (a + b) / 2, std::nextafter((a + b) / 2, 0.0f), std::nextafter((a + b) / 2, 1e9f)});
  }
  for (int i = -400; i <= 400; ++i) values.push_back(std::ldexp(1.37f, i / 40));
  for (float v : values) EXPECT_EQ(f32_to_f8e4m3(v), brute(v)) << v;
}

TEST(DType, E2M1AndE8M0) {
  const float expect[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint8_t c = 0; c < 8; ++c) {
    EXPECT_EQ(e2m1_to_f32(c), expect[c]);
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c | 8)), -expect[c]);
    EXPECT_EQ(f32_to_e2m1(expect[c]), c);
  }
  EXPECT_EQ(f32_to_e2m1(100.0f), 7);
  // Nearest magnitude; a value halfway between two goes to the even code; the sign is kept (also for zero).
  const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const uint8_t tie[7] = {0, 2, 2, 4, 4, 6, 6};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(f32_to_e2m1(mid[i]), tie[i]) << mid[i];
    EXPECT_EQ(f32_to_e2m1(-mid[i]), tie[i] | 8) << -mid[i];
    EXPECT_EQ(f32_to_e2m1(std::nextafter(mid[i], 0.0f)), i) << mid[i];
    EXPECT_EQ(f32_to_e2m1(std::nextafter(mid[i], 10.0f)), i + 1) << mid[i];
  }
  EXPECT_EQ(f32_to_e2m1(-0.0f), 8);
  EXPECT_EQ(f32_to_e2m1(std::nanf("")), 0);
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
}

TEST(Tensor, ShapeOverflowIsAnError) {
  EXPECT_THROW(shape_numel({int64_t{1} << 40, int64_t{1} << 40}), Error);
  EXPECT_THROW(shape_numel({-1}), Error);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({3, 0}), 0);
}

// The encoder the FP8 paths' host references use (the device's __nv_cvt_float_to_fp8 with __NV_SATFINITE).
TEST(DType, F8E4m3CodesRoundTrip) {
  int finite = 0;
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = f8e4m3_to_f32(code);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    ++finite;
    // -0 encodes as 0x80, every other code as itself.
    EXPECT_EQ(f32_to_f8e4m3(v), code) << c << " = " << v;
  }
  EXPECT_EQ(finite, 254);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
}

TEST(DType, F8E4m3RoundsToNearestEvenAndSaturates) {
  // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even mantissa, just past it up.
  EXPECT_EQ(f32_to_f8e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_f8e4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(f32_to_f8e4m3(1.1875f), 0x3a);  // 1.125 | 1.25 midpoint: even is 1.25 (mantissa 2)
  // Subnormals: 2^-10 is halfway between 0 and 2^-9 -> 0; 3 x 2^-10 -> 2 x 2^-9 (even).
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(3.0f, -10)), 0x02);
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(15.0f, -10)), 0x08);  // 7.5 x 2^-9 -> 8 x 2^-9 = 2^-6, the smallest normal
  EXPECT_EQ(f32_to_f8e4m3(-1.0f), 0xb8);
  EXPECT_EQ(f32_to_f8e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(460.0f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_f8e4m3(NAN), 0x7f);
  // Every float between two neighbouring codes goes to the nearer one (a sweep over [2^-12, 448]).
  for (float v = std::ldexp(1.0f, -12); v < 448.0f; v *= 1.0137f) {
    const float got = f8e4m3_to_f32(f32_to_f8e4m3(v));
    const uint8_t code = f32_to_f8e4m3(v);
    const float up = code == 0x7e ? INFINITY : f8e4m3_to_f32(static_cast<uint8_t>(code + 1));  // 0x7f: NaN
    const float down = code == 0 ? 0.0f : f8e4m3_to_f32(static_cast<uint8_t>(code - 1));
    EXPECT_LE(std::fabs(got - v), std::fabs(up - v)) << v;
    EXPECT_LE(std::fabs(got - v), std::fabs(down - v)) << v;
  }
}

}  // namespace
}  // namespace bg

// Host side of the FP8 prefill path (ops/moe/moe_fp8.h): the block scales,
// the exactness of the MXFP4 -> E4M3 conversion and where it ends, the activation quantization's error bound, and the
// layouts (no overlap, every scale of a plan in exactly one place).
#include "ops/moe/moe_fp8.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops {
namespace {

TEST(MoeFp8, WeightScaleExponentIsTheSmallestThatFits) {
  EXPECT_EQ(fp8_weight_scale_exponent(0.0f), 0);
  EXPECT_EQ(fp8_weight_scale_exponent(448.0f), 0);
  EXPECT_EQ(fp8_weight_scale_exponent(449.0f), 1);
  EXPECT_EQ(fp8_weight_scale_exponent(6.0f), -6);  // 6 <= 7 = 448 x 2^-6 < 2 x 3.5
  for (float a = 1e-20f; a < 1e20f; a *= 1.37f) {
    const int s = fp8_weight_scale_exponent(a);
    EXPECT_LE(a, std::ldexp(448.0f, s)) << a;
    EXPECT_GT(a, std::ldexp(448.0f, s - 1)) << a;
  }
}

// One row of 128 MXFP4 values: four groups of 32 whose scales are `exps` (any E2M1 codes, the ±6 code present in each).
std::vector<float> mxfp4_row(const int (&exps)[4], uint32_t seed) {
  static constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  std::vector<float> row;
  for (int g = 0; g < 4; ++g) {
    for (int i = 0; i < 32; ++i) {
      seed = seed * 1664525u + 1013904223u;
      const int code = i == 0 ? 7 : static_cast<int>(seed >> 28) & 15;
      const float mag = kE2m1[code & 7] * std::ldexp(1.0f, exps[g]);
      row.push_back((code & 8) != 0 ? -mag : mag);
    }
  }
  return row;
}

TEST(MoeFp8, Mxfp4ConvertsExactlyWithinFourteenBinades) {
  int64_t inexact = -1;
  // Spans of 0 .. 14 binades between a block's largest and smallest group scale: exact.
  for (int span = 0; span <= 14; ++span) {
    for (int top : {-20, -3, 0, 5}) {
      const int exps[4] = {top, top - span, top - span / 2, top - 1};
      const std::vector<float> w = mxfp4_row(exps, static_cast<uint32_t>(span * 31 + top + 100));
      const std::vector<float> got = fp8_convert_weight_emulated(w, 1, 128, &inexact);
      EXPECT_EQ(inexact, 0) << "span " << span << " top " << top;
      EXPECT_EQ(got, w) << "span " << span << " top " << top;
    }
  }
  // 15 binades: the smallest group's 0.5 x 2^e falls below E4M3's subnormals.
  const int exps[4] = {0, -15, -15, -15};
  const std::vector<float> got = fp8_convert_weight_emulated(mxfp4_row(exps, 7), 1, 128, &inexact);
  EXPECT_EQ(inexact, 1);
  // Two rows and a partial block: blocks are per row and per 128 inputs.
  std::vector<float> two = mxfp4_row(exps, 9);
  const int fine[4] = {1, 0, -2, 1};
  const std::vector<float> second = mxfp4_row(fine, 10);
  two.insert(two.end(), second.begin(), second.end());
  fp8_convert_weight_emulated(two, 2, 128, &inexact);
  EXPECT_EQ(inexact, 1);
  const std::vector<float> partial(std::vector<float>(second.begin(), second.begin() + 64));
  EXPECT_EQ(fp8_convert_weight_emulated(partial, 1, 64, &inexact), partial);
  EXPECT_EQ(inexact, 0);
}

// The conversion kernel's fast path (fp8_convert_fast): (lane x 2^126) x 2^e gives the E4M3 code of the exact
// weight (the W4A16 decode's bf16 arithmetic) under a block scale 2^S, for every E2M1 code, every stored scale byte
// and shift it applies to, and every S from the weight's own up to far past fp32's subnormals.
TEST(MoeFp8, ConvertFastPathGivesTheExactWeightsCodes) {
  for (int s_prime = 121; s_prime <= 254; ++s_prime) EXPECT_TRUE(fp8_convert_fast(s_prime, 0)) << s_prime;
  EXPECT_FALSE(fp8_convert_fast(120, 0));
  EXPECT_FALSE(fp8_convert_fast(254, 124));
  int64_t checked = 0;
  for (const int shift : {0, 1, 2, 5, 40, 100, 123}) {
    const float shift_f = std::ldexp(1.0f, shift);
    for (int s_prime = 1; s_prime <= 254; ++s_prime) {
      if (!fp8_convert_fast(s_prime, shift)) continue;
      const auto scale_bits = static_cast<uint16_t>(w4::scale_bf16x2(static_cast<uint32_t>(s_prime)) & 0xffffu);
      const float scale = bf16_to_f32(scale_bits);
      for (uint32_t code = 0; code < 16; ++code) {
        const uint32_t lane = ((code & 7u) << 6) | ((code >> 3) << 15);  // w4::kCodeBitTarget
        const float w = bf16_to_f32(f32_to_bf16(bf16_to_f32(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(lane)) *
                                                                        scale)) * shift_f));
        const int own = fp8_weight_scale_exponent(std::fabs(w));
        for (int s = own; s <= own + 180; s += 1) {
          const float c = std::ldexp(1.0f, fp8_convert_exponent(s_prime, shift, s));
          const float fast = std::bit_cast<float>(lane << 16) * 0x1p126f * c;
          ASSERT_EQ(f32_to_f8e4m3(fast), f32_to_f8e4m3(std::ldexp(w, -s)))
              << "code " << code << " s' " << s_prime << " shift " << shift << " S " << s;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 1000000);
}

TEST(MoeFp8, ActivationQuantizationErrorBound) {
  std::vector<float> x;
  uint32_t seed = 5;
  const int64_t rows = 3, width = 300;  // a partial third block
  for (int64_t i = 0; i < rows * width; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const float u = static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
    x.push_back(u * std::ldexp(1.0f, static_cast<int>(i % 23) - 11));  // magnitudes over 22 binades
  }
  x[7] = 0.0f;
  for (int64_t k = 256; k < 300; ++k) x[static_cast<size_t>(2 * width + k)] = 0.0f;  // an all-zero block
  const std::vector<float> q = fp8_quantize_rows_emulated(x, rows, width);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b0 = 0; b0 < width; b0 += kFp8BlockInputs) {
      float amax = 0.0f;
      const int64_t b1 = std::min<int64_t>(width, b0 + kFp8BlockInputs);
      for (int64_t k = b0; k < b1; ++k) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * width + k)]));
      const float s = fp8_activation_scale(amax);
      for (int64_t k = b0; k < b1; ++k) {
        const float v = x[static_cast<size_t>(r * width + k)], got = q[static_cast<size_t>(r * width + k)];
        // Normal range: half a mantissa step (2^-4 relative); subnormal range: half of 2^-9 scale.
        const float bound = std::max(std::fabs(v) * 0.0625f, s * std::ldexp(1.0f, -10)) * 1.0001f;
        EXPECT_LE(std::fabs(got - v), bound) << r << "," << k;
      }
    }
  }
  EXPECT_EQ(q[7], 0.0f);
  EXPECT_EQ(q[static_cast<size_t>(2 * width + 280)], 0.0f);
  EXPECT_EQ(fp8_activation_scale(0.0f), 1.0f);
}

TEST(MoeFp8, LayoutsAreAlignedAndDisjoint) {
  const MoeFp8ExpertLayout e = moe_fp8_expert_layout(3584, 3072);
  EXPECT_EQ(e.gate_up, 0u);
  EXPECT_EQ(e.down, size_t{2} * 3072 * 3584);
  EXPECT_EQ(e.gate_up_scale, e.down + size_t{3584} * 3072);
  EXPECT_EQ(e.down_scale, e.gate_up_scale + size_t{28} * 6144 * 4);
  EXPECT_EQ(e.bytes, e.down_scale + size_t{24} * 3584 * 4);
  const MoeFp8ExpertLayout g = moe_fp8_expert_layout(128, 64);  // partial blocks round up
  for (size_t off : {g.down, g.gate_up_scale, g.down_scale, g.bytes}) EXPECT_EQ(off % 256, 0u);
  EXPECT_GE(g.down_scale - g.gate_up_scale, size_t{1} * 128 * 4);
  EXPECT_GE(g.bytes - g.down_scale, size_t{1} * 128 * 4);
  EXPECT_THROW(moe_fp8_expert_layout(0, 64), Error);

  const MoeGroupedPlan plan = moe_grouped_plan(std::vector<int32_t>{3, 0, 5, 1, 0, 7}, 300, 200, 2, 64);
  const std::vector<int64_t> r0 = fp8_scale_row0(plan);
  EXPECT_EQ(r0, (std::vector<int64_t>{0, 16, 32, 48, 64}));  // each expert's rows padded to kFp8RowAlign
  const MoeFp8CallLayout c = moe_fp8_call_layout(plan);
  const size_t rows = 16 + 16, scale_rows = 64;  // + the spare rows the last expert's padding reads
  EXPECT_GE(c.x_scale - c.x, rows * 300);
  EXPECT_GE(c.h - c.x_scale, scale_rows * 3 * 4);
  EXPECT_GE(c.h_scale - c.h, rows * 200);
  EXPECT_GE(c.gu - c.h_scale, scale_rows * 2 * 4);
  EXPECT_GE(c.tail - c.gu, (static_cast<size_t>(plan.max_group_rows) + 16) * 400 * 2);
  EXPECT_GE(c.table - c.tail, size_t{16} * 300 * 2);  // the last expert's 7 rows, padded
  EXPECT_GE(c.block_scale - c.table, 2 * (plan.slots.size() + 1) * 8);
  // FP8-block scales of [200 x 300] (gate, up: 2 x 3 blocks, rows padded to 4) and [300 x 200] (down: 3 x 2 -> 3 x 4).
  EXPECT_EQ(fp8_block_scale_ld(300), 4);
  EXPECT_EQ(fp8_block_scale_ld(7168), 56);
  EXPECT_EQ(fp8_block_scale_ld(2048), 16);
  EXPECT_GE(c.bytes - c.block_scale, size_t{3} * 4 * 4);
  for (size_t off : {c.x_scale, c.h, c.h_scale, c.gu, c.tail, c.table, c.block_scale, c.bytes}) {
    EXPECT_EQ(off % 256, 0u);
  }
  // Which experts' padded y would run past the 16 rows: all but the first (3 rows from 0: padded to 16, ends at 16).
  EXPECT_FALSE(fp8_y_spills(plan, 0));
  for (size_t i = 1; i < 4; ++i) EXPECT_TRUE(fp8_y_spills(plan, i)) << i;
  // Not only the last: 40 rows then 2 -> the first expert's 48 padded rows run 6 past the end; the tail holds 48.
  const MoeGroupedPlan two = moe_grouped_plan(std::vector<int32_t>{40, 2}, 300, 200, 2, 64);
  EXPECT_TRUE(fp8_y_spills(two, 0));
  EXPECT_TRUE(fp8_y_spills(two, 1));
  const MoeFp8CallLayout t = moe_fp8_call_layout(two);
  EXPECT_GE(t.table - t.tail, size_t{48} * 300 * 2);
  const MoeGroupedPlan exact = moe_grouped_plan(std::vector<int32_t>{32, 16}, 300, 200, 2, 64);
  EXPECT_FALSE(fp8_y_spills(exact, 0));
  EXPECT_FALSE(fp8_y_spills(exact, 1));
  EXPECT_EQ(fp8_padded_rows(1), 16);
  EXPECT_EQ(fp8_padded_rows(16), 16);
  EXPECT_EQ(fp8_padded_rows(61), 64);
  // Every (row, block) of every expert has its own scale index inside the buffer, each expert's tensor starts
  // 16-byte aligned, and no two experts' tensors overlap.
  for (int64_t width : {300, 128, 64}) {
    std::set<int64_t> seen;
    int64_t count = 0;
    for (size_t i = 0; i < plan.slots.size(); ++i) {
      EXPECT_EQ(fp8_row_scale_index(width, r0[i], plan.rows[i], 0, 0) % 16, 0) << i;
      for (int64_t r = 0; r < plan.rows[i]; ++r) {
        for (int64_t b = 0; b < fp8_blocks(width); ++b) {
          const int64_t at = fp8_row_scale_index(width, r0[i], plan.rows[i], r, b);
          EXPECT_GE(at, fp8_blocks(width) * r0[i]);
          EXPECT_LT(at, fp8_blocks(width) * r0[i + 1]);
          seen.insert(at);
          ++count;
        }
      }
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), count);
    EXPECT_EQ(count, 16 * fp8_blocks(width));
    EXPECT_LT(*seen.rbegin(), 64 * fp8_blocks(width));
  }
}

}  // namespace
}  // namespace bg::ops

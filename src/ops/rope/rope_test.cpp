// RoPE tables (default and YaRN, as transformers 5 computes them) against values worked out here in double from the
// formulas of docs/reference.md §1, the YaRN softmax-scale multiplier, and the rotation (interleaved / NeoX) itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "core/error.h"
#include "formats/model_config.h"
#include "ops/rope/rope.h"

namespace bg::ops {
namespace {

constexpr int64_t kDim = 64;

RopeConfig yarn_config(double theta, double factor, double beta_fast, double beta_slow, int64_t original) {
  RopeConfig r;
  r.type = "yarn";
  r.theta = theta;
  r.factor = factor;
  r.beta_fast = beta_fast;
  r.beta_slow = beta_slow;
  r.original_max_position_embeddings = original;
  r.mscale = 1.0;
  r.mscale_all_dim = 1.0;
  return r;
}

// 1 / base^(2i/dim), the un-scaled ("extrapolation") frequency.
double plain_inv_freq(double base, int64_t i, int64_t dim) {
  return 1.0 / std::pow(base, 2.0 * static_cast<double>(i) / static_cast<double>(dim));
}

// corr(r) = dim * ln(L0 / (2 pi r)) / (2 ln base)
double correction_dim(double r, double original, double base, int64_t dim) {
  return static_cast<double>(dim) * std::log(original / (2.0 * std::numbers::pi * r)) / (2.0 * std::log(base));
}

// The YaRN table of reference.md in double, with the truncating floor/ceil and the given interpolation factor.
std::vector<double> yarn_inv_freq(double base, double factor, double beta_fast, double beta_slow, double original,
                                  int64_t dim) {
  double low = std::max(std::floor(correction_dim(beta_fast, original, base, dim)), 0.0);
  double high = std::min(std::ceil(correction_dim(beta_slow, original, base, dim)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  std::vector<double> out;
  for (int64_t i = 0; i < dim / 2; ++i) {
    double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    double ext = plain_inv_freq(base, i, dim);
    out.push_back(ext / factor * ramp + ext * (1.0 - ramp));
  }
  return out;
}

double get_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

void expect_rel_near(double got, double want, double rel, const std::string& what) {
  EXPECT_NEAR(got, want, rel * std::abs(want)) << what;
}

TEST(Rope, DefaultTableIsPlainInverseFrequencies) {
  RopeConfig r;  // rope_type "default"
  for (double theta : {1e4, 5e4}) {
    r.theta = theta;
    for (int64_t dim : {int64_t{16}, kDim}) {
      RopeTable t = compute_rope_table(r, dim, 4096);
      ASSERT_EQ(t.inv_freq.size(), static_cast<size_t>(dim / 2));
      EXPECT_EQ(t.attention_factor, 1.0f);
      for (int64_t i = 0; i < dim / 2; ++i)
        expect_rel_near(t.inv_freq[static_cast<size_t>(i)], plain_inv_freq(theta, i, dim), 1e-6,
                        "theta " + std::to_string(theta) + " i " + std::to_string(i));
    }
  }
  EXPECT_EQ(yarn_softmax_scale_multiplier(r), 1.0);
}

TEST(Rope, DeepseekV3YarnTable) {
  const double theta = 1e4, factor = 40.0;
  // The correction dims that reference.md gives for DeepSeek-V3, recomputed here.
  EXPECT_EQ(std::floor(correction_dim(32.0, 4096.0, theta, kDim)), 10.0);
  EXPECT_EQ(std::ceil(correction_dim(1.0, 4096.0, theta, kDim)), 23.0);
  RopeTable t = compute_rope_table(yarn_config(theta, factor, 32.0, 1.0, 4096), kDim, 163840);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  EXPECT_EQ(t.attention_factor, 1.0f);  // mscale == mscale_all_dim
  for (int64_t i = 0; i < 32; ++i) {
    double ext = plain_inv_freq(theta, i, kDim);
    double want;
    if (i <= 10) {
      want = ext;  // extrapolated: the original frequency
    } else if (i >= 23) {
      want = ext / factor;  // interpolated
    } else {
      double ramp = static_cast<double>(i - 10) / 13.0;
      want = ext / factor * ramp + ext * (1.0 - ramp);
    }
    expect_rel_near(t.inv_freq[static_cast<size_t>(i)], want, 1e-6, "i " + std::to_string(i));
  }
}

TEST(Rope, KimiYarnTable) {
  const double theta = 5e4, factor = 32.0;
  const double corr = correction_dim(1.0, 4096.0, theta, kDim);
  EXPECT_NEAR(corr, 19.16, 0.01);  // reference.md
  RopeTable t = compute_rope_table(yarn_config(theta, factor, 1.0, 1.0, 4096), kDim, 131072);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  EXPECT_EQ(t.attention_factor, 1.0f);
  // low, high = 19, 20: dims i <= 19 keep the original frequency, i >= 20 are divided by the factor.
  for (int64_t i = 0; i < 32; ++i) {
    double ext = plain_inv_freq(theta, i, kDim);
    double want = i <= 19 ? ext : ext / factor;
    expect_rel_near(t.inv_freq[static_cast<size_t>(i)], want, 1e-6, "i " + std::to_string(i));
  }
}

TEST(Rope, YarnOtherBetasAndNoTruncate) {
  // A generic configuration through the double formula, truncating and not.
  RopeConfig r = yarn_config(2e4, 8.0, 16.0, 2.0, 2048);
  for (bool truncate : {true, false}) {
    r.truncate = truncate;
    RopeTable t = compute_rope_table(r, 32, 16384);  // 16384 / 2048 = 8 = factor
    double low = correction_dim(16.0, 2048.0, 2e4, 32), high = correction_dim(2.0, 2048.0, 2e4, 32);
    if (truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, 31.0);
    for (int64_t i = 0; i < 16; ++i) {
      double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      double ext = plain_inv_freq(2e4, i, 32);
      expect_rel_near(t.inv_freq[static_cast<size_t>(i)], ext / 8.0 * ramp + ext * (1.0 - ramp), 1e-6,
                      "truncate " + std::to_string(truncate) + " i " + std::to_string(i));
    }
  }
}

TEST(Rope, YarnAttentionFactor) {
  RopeConfig r = yarn_config(1e4, 40.0, 32.0, 1.0, 4096);
  EXPECT_EQ(compute_rope_table(r, kDim, 163840).attention_factor, 1.0f);
  // mscale != mscale_all_dim: get_mscale(f, mscale) / get_mscale(f, mscale_all_dim).
  r.mscale = 1.0;
  r.mscale_all_dim = 0.5;
  expect_rel_near(compute_rope_table(r, kDim, 163840).attention_factor,
                  (0.1 * std::log(40.0) + 1.0) / (0.05 * std::log(40.0) + 1.0), 1e-6, "1 / 0.5");
  r.mscale = 0.707;
  r.mscale_all_dim = 1.0;
  expect_rel_near(compute_rope_table(r, kDim, 163840).attention_factor, get_mscale(40.0, 0.707) / get_mscale(40.0, 1.0),
                  1e-6, "0.707 / 1");
  // mscale_all_dim 0 (falsy): get_mscale(f) = 0.1 ln f + 1.
  r.mscale_all_dim = 0.0;
  expect_rel_near(compute_rope_table(r, kDim, 163840).attention_factor, 0.1 * std::log(40.0) + 1.0, 1e-6,
                  "mscale_all_dim 0");
  // An explicit attention_factor wins over both.
  r.mscale_all_dim = 0.5;
  r.attention_factor = 0.8125;
  EXPECT_EQ(compute_rope_table(r, kDim, 163840).attention_factor, 0.8125f);
}

TEST(Rope, YarnFactorComesFromMaxOverOriginal) {
  // transformers 5: with original_max_position_embeddings given, the factor used for inv_freq and attention_factor
  // is max_position_embeddings / original (16 here), not the config's `factor` (40).
  RopeConfig r = yarn_config(1e4, 40.0, 32.0, 1.0, 4096);
  r.mscale = 1.0;
  r.mscale_all_dim = 0.5;
  RopeTable t = compute_rope_table(r, kDim, 65536);
  std::vector<double> want = yarn_inv_freq(1e4, 16.0, 32.0, 1.0, 4096.0, kDim);
  for (size_t i = 0; i < want.size(); ++i) expect_rel_near(t.inv_freq[i], want[i], 1e-6, "i " + std::to_string(i));
  EXPECT_NEAR(t.inv_freq[31], plain_inv_freq(1e4, 31, kDim) / 16.0, 1e-6 * t.inv_freq[31]);
  expect_rel_near(t.attention_factor, get_mscale(16.0, 1.0) / get_mscale(16.0, 0.5), 1e-6, "attention_factor");
  // The softmax multiplier still uses the config's factor, as DeepseekV3Attention does.
  double m = 0.1 * 0.5 * std::log(40.0) + 1.0;
  EXPECT_NEAR(yarn_softmax_scale_multiplier(r), m * m, 1e-12);
}

TEST(Rope, YarnSoftmaxScale) {
  const double base_scale = 1.0 / std::sqrt(192.0);
  const std::pair<double, double> cases[] = {{40.0, 0.135234}, {32.0, 0.130861}, {64.0, 0.144680}};
  for (auto [factor, want] : cases) {
    RopeConfig r = yarn_config(1e4, factor, 32.0, 1.0, 4096);
    EXPECT_NEAR(base_scale * yarn_softmax_scale_multiplier(r), want, 1e-5) << "factor " << factor;
  }
  RopeConfig r = yarn_config(1e4, 40.0, 32.0, 1.0, 4096);
  r.mscale_all_dim = 0.0;
  EXPECT_EQ(yarn_softmax_scale_multiplier(r), 1.0);
  r.mscale_all_dim = 1.0;
  r.factor = 1.0;  // m = 1 when factor <= 1
  EXPECT_EQ(yarn_softmax_scale_multiplier(r), 1.0);
}

TEST(Rope, RejectsBadTables) {
  RopeConfig r;
  EXPECT_THROW(compute_rope_table(r, 0, 4096), Error);
  EXPECT_THROW(compute_rope_table(r, 7, 4096), Error);
  r.type = "longrope";
  EXPECT_THROW(compute_rope_table(r, 64, 4096), Error);
}

// Rotation layout for the apply tests: heads of `head_dim` floats padded to `head_stride`, tokens padded further.
struct Layout {
  int64_t n_tokens = 4, n_heads = 3, head_dim = 40, head_stride = 44, rope_offset = 24, rope_dim = 16;
  int64_t token_stride() const { return n_heads * head_stride + 5; }
  int64_t size() const { return n_tokens * token_stride(); }
  RopeParams params(bool interleaved) const {
    return {n_tokens, n_heads, head_stride, token_stride(), rope_offset, rope_dim, interleaved};
  }
};

std::vector<float> random_vector(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(rng);
  return v;
}

// Rotation of one head's rope slice by the hand formulas; the angle is formed as position * inv_freq in fp32, as
// transformers does, then taken in double.
std::vector<double> rotate_expected(const float* v, const RopeTable& t, int64_t pos, int64_t rope_dim, bool interl) {
  int64_t half = rope_dim / 2;
  std::vector<double> out(static_cast<size_t>(rope_dim));
  for (int64_t i = 0; i < half; ++i) {
    double angle = static_cast<double>(static_cast<float>(pos) * t.inv_freq[static_cast<size_t>(i)]);
    double c = std::cos(angle) * t.attention_factor, s = std::sin(angle) * t.attention_factor;
    int64_t a = interl ? 2 * i : i, b = interl ? 2 * i + 1 : i + half;
    out[static_cast<size_t>(a)] = v[a] * c - v[b] * s;
    out[static_cast<size_t>(b)] = v[a] * s + v[b] * c;
  }
  return out;
}

void check_apply(bool interleaved, float attention_factor) {
  Layout l;
  RopeTable t = compute_rope_table(yarn_config(1e4, 40.0, 32.0, 1.0, 4096), l.rope_dim, 163840);
  t.attention_factor = attention_factor;
  const std::vector<int64_t> positions = {0, 1, 517, 4999};
  std::vector<float> x0 = random_vector(l.size(), 11), x = x0;
  apply_rope_cpu(l.params(interleaved), t, positions.data(), x.data());
  for (int64_t tok = 0; tok < l.n_tokens; ++tok) {
    for (int64_t h = 0; h < l.n_heads; ++h) {
      int64_t head = tok * l.token_stride() + h * l.head_stride;
      std::vector<double> want = rotate_expected(x0.data() + head + l.rope_offset, t,
                                                 positions[static_cast<size_t>(tok)], l.rope_dim, interleaved);
      double norm0 = 0.0, norm1 = 0.0;
      for (int64_t d = 0; d < l.rope_dim; ++d) {
        float got = x[static_cast<size_t>(head + l.rope_offset + d)];
        EXPECT_NEAR(got, want[static_cast<size_t>(d)], 1e-5) << "token " << tok << " head " << h << " dim " << d;
        norm0 += static_cast<double>(x0[static_cast<size_t>(head + l.rope_offset + d)]) *
                 x0[static_cast<size_t>(head + l.rope_offset + d)];
        norm1 += static_cast<double>(got) * got;
      }
      // A rotation preserves the norm; attention_factor scales it.
      EXPECT_NEAR(std::sqrt(norm1), attention_factor * std::sqrt(norm0), 1e-5 * std::sqrt(norm0));
    }
  }
}

TEST(Rope, ApplyInterleavedMatchesPairFormula) {
  check_apply(true, 1.0f);
  check_apply(true, 1.25f);
}

TEST(Rope, ApplyNeoxMatchesHalvesFormula) {
  check_apply(false, 1.0f);
  check_apply(false, 1.25f);
}

TEST(Rope, InterleavedAndNeoxDiffer) {
  Layout l;
  l.n_tokens = 1;
  RopeTable t = compute_rope_table(RopeConfig{}, l.rope_dim, 4096);
  const int64_t pos = 3;
  const std::vector<float> x0 = random_vector(l.size(), 5);
  std::vector<float> a = x0, b = x0;
  apply_rope_cpu(l.params(true), t, &pos, a.data());
  apply_rope_cpu(l.params(false), t, &pos, b.data());
  EXPECT_NE(a, b);
  // Interleaved: dims 0 and 1 are a pair rotated by theta_0 = pos.
  const float* v = a.data() + l.rope_offset;
  const float* u = x0.data() + l.rope_offset;
  EXPECT_NEAR(v[0], u[0] * std::cos(3.0) - u[1] * std::sin(3.0), 1e-5);
  EXPECT_NEAR(v[1], u[0] * std::sin(3.0) + u[1] * std::cos(3.0), 1e-5);
  // NeoX: dims 0 and 8 (= rope_dim / 2) are the pair rotated by theta_0.
  const float* w = b.data() + l.rope_offset;
  EXPECT_NEAR(w[0], u[0] * std::cos(3.0) - u[8] * std::sin(3.0), 1e-5);
  EXPECT_NEAR(w[8], u[0] * std::sin(3.0) + u[8] * std::cos(3.0), 1e-5);
}

TEST(Rope, PositionZeroIsIdentity) {
  Layout l;
  RopeTable t = compute_rope_table(yarn_config(5e4, 32.0, 1.0, 1.0, 4096), l.rope_dim, 131072);
  const std::vector<int64_t> positions(static_cast<size_t>(l.n_tokens), 0);
  for (bool interleaved : {true, false}) {
    std::vector<float> x0 = random_vector(l.size(), 17), x = x0;
    apply_rope_cpu(l.params(interleaved), t, positions.data(), x.data());
    EXPECT_EQ(x, x0) << "interleaved " << interleaved;
  }
}

TEST(Rope, OnlyTheRopeSliceChanges) {
  Layout l;
  RopeTable t = compute_rope_table(RopeConfig{}, l.rope_dim, 4096);
  const std::vector<int64_t> positions = {7, 8, 9, 10};
  for (bool interleaved : {true, false}) {
    std::vector<float> x0 = random_vector(l.size(), 23), x = x0;
    apply_rope_cpu(l.params(interleaved), t, positions.data(), x.data());
    int64_t n_changed = 0;
    for (int64_t i = 0; i < l.size(); ++i) {
      int64_t in_token = i % l.token_stride();
      int64_t h = in_token / l.head_stride, d = in_token % l.head_stride;
      bool in_slice = h < l.n_heads && d >= l.rope_offset && d < l.rope_offset + l.rope_dim;
      if (!in_slice) {
        EXPECT_EQ(x[static_cast<size_t>(i)], x0[static_cast<size_t>(i)]) << "index " << i << " outside the slice";
      } else {
        n_changed += x[static_cast<size_t>(i)] != x0[static_cast<size_t>(i)];
      }
    }
    // Every slice element moves (positions are nonzero and the values random).
    EXPECT_EQ(n_changed, l.n_tokens * l.n_heads * l.rope_dim);
  }
}

TEST(Rope, ApplyRejectsMismatchedTable) {
  Layout l;
  RopeTable t = compute_rope_table(RopeConfig{}, 32, 4096);
  std::vector<float> x(static_cast<size_t>(l.size()));
  const std::vector<int64_t> positions(static_cast<size_t>(l.n_tokens), 1);
  EXPECT_THROW(apply_rope_cpu(l.params(true), t, positions.data(), x.data()), Error);
}

}  // namespace
}  // namespace bg::ops

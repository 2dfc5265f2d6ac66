// Short conv + SiLU: one call vs token-by-token vs split calls, against a direct zero-padded float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/short_conv/short_conv.h"

namespace bg::ops {
namespace {

struct ConvCase {
  int64_t n_tokens, n_channels, kernel_size;
};

std::vector<float> random_vec(int64_t n, uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sd);
  std::vector<float> x(n);
  for (auto& e : x) e = normal(rng);
  return x;
}

// out[t][c] = silu(sum_j w[c][j] x[t-(W-1)+j][c]) with x = 0 before token 0.
std::vector<double> reference(const ConvCase& c, const std::vector<float>& x, const std::vector<float>& w) {
  std::vector<double> out(c.n_tokens * c.n_channels);
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    for (int64_t ch = 0; ch < c.n_channels; ++ch) {
      double acc = 0.0;
      for (int64_t j = 0; j < c.kernel_size; ++j) {
        const int64_t s = t - (c.kernel_size - 1) + j;
        if (s >= 0) acc += static_cast<double>(w[ch * c.kernel_size + j]) * x[s * c.n_channels + ch];
      }
      out[t * c.n_channels + ch] = acc / (1.0 + std::exp(-acc));
    }
  }
  return out;
}

// Runs x through short_conv_cpu in calls of the given lengths (summing to T), from a zero state.
std::vector<float> run_in_pieces(const ConvCase& c, const std::vector<float>& x, const std::vector<float>& w,
                                 const std::vector<int64_t>& pieces, std::vector<float>& state) {
  state.assign(c.n_channels * (c.kernel_size - 1), 0.0f);
  std::vector<float> out(x.size(), NAN);
  int64_t t0 = 0;
  for (int64_t n : pieces) {
    const ShortConvParams p{n, c.n_channels, c.kernel_size};
    short_conv_cpu(p, x.data() + t0 * c.n_channels, w.data(), state.data(), out.data() + t0 * c.n_channels);
    t0 += n;
  }
  EXPECT_EQ(t0, c.n_tokens);
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST(ShortConv, OneCallTokenByTokenAndSplitAgreeWithReference) {
  for (const ConvCase& c : {ConvCase{1, 8, 4}, ConvCase{2, 5, 4}, ConvCase{37, 96, 4}, ConvCase{130, 33, 4},
                            ConvCase{20, 16, 1}, ConvCase{20, 16, 2}, ConvCase{20, 16, 7}}) {
    SCOPED_TRACE(testing::Message() << "T=" << c.n_tokens << " C=" << c.n_channels << " W=" << c.kernel_size);
    const auto x = random_vec(c.n_tokens * c.n_channels, 11, 2.0f);
    const auto w = random_vec(c.n_channels * c.kernel_size, 12, 0.7f);
    const auto ref = reference(c, x, w);

    std::vector<float> state_one, state_tok, state_split;
    const auto one = run_in_pieces(c, x, w, {c.n_tokens}, state_one);
    EXPECT_LE(max_abs_diff(one, ref), 1e-5);

    const auto tok = run_in_pieces(c, x, w, std::vector<int64_t>(c.n_tokens, 1), state_tok);
    EXPECT_EQ(tok, one);
    EXPECT_EQ(state_tok, state_one);

    // Ragged pieces including empty calls and calls shorter than W-1.
    std::vector<int64_t> pieces;
    int64_t left = c.n_tokens;
    for (int64_t n : {0, 2, 1, 0, 5, 3}) {
      const int64_t take = std::min(n, left);
      pieces.push_back(take);
      left -= take;
    }
    pieces.push_back(left);
    const auto split = run_in_pieces(c, x, w, pieces, state_split);
    EXPECT_EQ(split, one);
    EXPECT_EQ(state_split, state_one);

    // The final state holds the last W-1 inputs, oldest first (zeros before token 0).
    const int64_t n_hist = c.kernel_size - 1;
    for (int64_t ch = 0; ch < c.n_channels; ++ch) {
      for (int64_t j = 0; j < n_hist; ++j) {
        const int64_t s = c.n_tokens - n_hist + j;
        EXPECT_EQ(state_one[ch * n_hist + j], s >= 0 ? x[s * c.n_channels + ch] : 0.0f);
      }
    }
  }
}

TEST(ShortConv, IdentityTapGivesSiluAndShiftsState) {
  // weight [0, 0, 0, 1]: out = silu(x) whatever the state; T = 2 < W-1 shifts one old entry through.
  const ShortConvParams p{2, 2, 4};
  const std::vector<float> x = {1.0f, -2.0f, -100.0f, 30.0f};  // [T=2, C=2]
  const std::vector<float> w = {0, 0, 0, 1, 0, 0, 0, 1};
  std::vector<float> state = {7, 8, 9, 4, 5, 6}, out(4);  // [C=2, W-1=3]
  short_conv_cpu(p, x.data(), w.data(), state.data(), out.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(out[i], x[i] / (1.0f + std::exp(-x[i])), 1e-6f);
  EXPECT_EQ(state, (std::vector<float>{9, 1, -100, 6, -2, 30}));
}

TEST(ShortConv, RejectsBadParams) {
  std::vector<float> x(8), w(8), state(8), out(8);
  EXPECT_THROW(short_conv_cpu({-1, 2, 4}, x.data(), w.data(), state.data(), out.data()), Error);
  EXPECT_THROW(short_conv_cpu({1, 0, 4}, x.data(), w.data(), state.data(), out.data()), Error);
  EXPECT_THROW(short_conv_cpu({1, 2, 0}, x.data(), w.data(), state.data(), out.data()), Error);
  EXPECT_THROW(short_conv_cpu({1, 2, 4}, x.data(), w.data(), nullptr, out.data()), Error);
  EXPECT_THROW(short_conv_cpu({1, 2, 4}, x.data(), w.data(), state.data(), x.data()), Error);
}

}  // namespace
}  // namespace bg::ops

// One step's CPU sampling (sample_rows_cpu) and the prefix selection without a top-k cut: the id equals the full
// sort's for many rows, temperatures, top_p values and uniforms (peaked, flat and heavily tied rows, vocabularies past
// the first 1024-entry prefix); finite flags for NaN / Inf rows; logprobs as top_logprobs_cpu; and the row checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/sampling/sampling.h"

namespace bg::ops {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> normal_row(int64_t vocab, float stddev, uint64_t seed, float quantum = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> row(static_cast<size_t>(vocab));
  for (float& v : row) {
    v = normal(rng);
    if (quantum > 0.0f) v = std::round(v / quantum) * quantum;  // many equal logits: ties broken by index
  }
  return row;
}

TEST(SamplingRows, PrefixSelectionPicksTheFullSortsId) {
  const std::vector<SamplingParams> params = {{1.0f, 0, 0.95f}, {1.0f, 0, 1.0f}, {0.7f, 0, 0.9f},
                                              {1.5f, 0, 0.5f},  {0.3f, 0, 1.0f}, {1.0f, 1 << 30, 0.8f},
                                              {2.0f, 0, 0.99f}, {1.0f, 0, 1e-6f}};
  std::mt19937_64 rng(5);
  int n_checked = 0;
  for (int64_t vocab : {int64_t{3000}, int64_t{12000}}) {
    for (float stddev : {1.0f, 3.0f, 8.0f}) {
      for (float quantum : {0.0f, 0.5f}) {
        const std::vector<float> row = normal_row(vocab, stddev, rng(), quantum);
        for (const SamplingParams& p : params) {
          for (int draw = 0; draw < 3; ++draw) {
            const double u = draw_uniform(rng);
            ASSERT_EQ(sample_token_with_uniform(p, row.data(), vocab, u),
                      sample_token_full_sort(p, row.data(), vocab, u))
                << "vocab " << vocab << " stddev " << stddev << " quantum " << quantum << " T " << p.temperature
                << " top_p " << p.top_p << " u " << u;
            ++n_checked;
          }
        }
      }
    }
  }
  EXPECT_EQ(n_checked, 2 * 3 * 2 * 8 * 3);
}

TEST(SamplingRows, PrefixSelectionAtTheEdgesOfTheUniform) {
  const int64_t vocab = 5000;
  const std::vector<float> row = normal_row(vocab, 2.0f, 17);
  for (double u : {0.0, 1e-12, 0.5, 1.0 - 1e-12, std::nextafter(1.0, 0.0)}) {
    for (float top_p : {1.0f, 0.95f, 0.3f}) {
      const SamplingParams p{1.0f, 0, top_p};
      EXPECT_EQ(sample_token_with_uniform(p, row.data(), vocab, u), sample_token_full_sort(p, row.data(), vocab, u))
          << "u " << u << " top_p " << top_p;
    }
  }
}

TEST(SamplingRows, RowsAreSampledLikeOneRowAtATime) {
  const int64_t vocab = 2000;
  std::vector<float> logits;
  for (int r = 0; r < 4; ++r) {
    const std::vector<float> row = normal_row(vocab, 2.0f, 100 + static_cast<uint64_t>(r));
    logits.insert(logits.end(), row.begin(), row.end());
  }
  const std::vector<RowSampling> rows = {
      {{0.0f, 0, 1.0f}, 0.0, 2, -1},   // greedy, row 2
      {{0.8f, 40, 1.0f}, 0.3, 0, 5},   // top-k with 5 logprobs
      {{1.0f, 0, 0.9f}, 0.77, 3, 0},   // top-p, the token's logprob only
      {{1.2f, 100, 0.8f}, 0.1, 1, 20}, // top-k + top-p, 20 logprobs
      {{1.0f, 0, 1.0f}, 0.5, 0, -1},   // the same logits row twice
  };
  std::vector<RowSample> out(rows.size());
  sample_rows_cpu(rows, logits.data(), 4, vocab, out);
  for (size_t i = 0; i < rows.size(); ++i) {
    const float* row = logits.data() + rows[i].row * vocab;
    EXPECT_TRUE(out[i].finite);
    EXPECT_EQ(out[i].token, sample_token_with_uniform(rows[i].params, row, vocab, rows[i].uniform)) << i;
    if (rows[i].n_top < 0) {
      EXPECT_EQ(out[i].n_top, 0);
      continue;
    }
    RowSample want;
    top_logprobs_cpu(row, vocab, out[i].token, rows[i].n_top, want);
    EXPECT_EQ(out[i].logprob, want.logprob);
    ASSERT_EQ(out[i].n_top, rows[i].n_top);
    for (int32_t k = 0; k < out[i].n_top; ++k) {
      EXPECT_EQ(out[i].top_ids[k], want.top_ids[k]);
      EXPECT_EQ(out[i].top_logprobs[k], want.top_logprobs[k]);
      if (k > 0) {
        EXPECT_LE(out[i].top_logprobs[k], out[i].top_logprobs[k - 1]);
      }
    }
  }
  EXPECT_EQ(out[0].token, argmax(logits.data() + 2 * vocab, vocab));
  EXPECT_EQ(out[3].top_ids[0], argmax(logits.data() + vocab, vocab));
}

TEST(SamplingRows, NonFiniteRowsAreFlaggedAndTheOthersSampled) {
  const int64_t vocab = 6;
  const std::vector<float> logits = {1, 2, 3, 4, 5, 6,  1, kNaN, 3, 4, 5, 6,  1, 2, kInf, 4, 5, 6,
                                     -kInf, 2, 3, 4, 5, 6};
  const std::vector<RowSampling> rows = {{{0.0f, 0, 1.0f}, 0.0, 0, 2},
                                         {{1.0f, 0, 0.9f}, 0.5, 1, 2},
                                         {{0.0f, 0, 1.0f}, 0.0, 2, -1},
                                         {{0.0f, 0, 1.0f}, 0.0, 3, -1}};
  std::vector<RowSample> out(rows.size());
  sample_rows_cpu(rows, logits.data(), 4, vocab, out);
  EXPECT_TRUE(out[0].finite);
  EXPECT_EQ(out[0].token, 5);
  EXPECT_EQ(out[0].n_top, 2);
  EXPECT_EQ(out[0].top_ids[1], 4);
  EXPECT_FALSE(out[1].finite);
  EXPECT_EQ(out[1].token, -1);
  EXPECT_FALSE(out[2].finite);
  EXPECT_EQ(out[2].token, -1);
  EXPECT_FALSE(out[3].finite);  // -inf is not finite either
}

TEST(SamplingRows, MoreLogprobsThanTheVocabularyGiveEveryId) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f};
  const std::vector<RowSampling> rows = {{{0.0f, 0, 1.0f}, 0.0, 0, 20}};
  std::vector<RowSample> out(1);
  sample_rows_cpu(rows, logits.data(), 1, 3, out);
  ASSERT_EQ(out[0].n_top, 3);
  EXPECT_EQ(out[0].top_ids[0], 1);
  EXPECT_EQ(out[0].top_ids[1], 2);
  EXPECT_EQ(out[0].top_ids[2], 0);
  EXPECT_NEAR(std::exp(out[0].top_logprobs[0]) * 2 + std::exp(out[0].top_logprobs[2]), 1.0, 1e-6);
}

TEST(SamplingRows, BadRowsAreErrors) {
  const std::vector<float> logits(8, 0.0f);
  std::vector<RowSample> out(1);
  auto run = [&](RowSampling r) { sample_rows_cpu(std::span(&r, 1), logits.data(), 2, 4, out); };
  EXPECT_THROW(run({{0.0f, 0, 1.0f}, 0.0, 2, -1}), Error);   // row out of range
  EXPECT_THROW(run({{0.0f, 0, 1.0f}, 0.0, -1, -1}), Error);
  EXPECT_THROW(run({{0.0f, 0, 1.0f}, 0.0, 0, 21}), Error);   // too many logprobs
  EXPECT_THROW(run({{0.0f, 0, 1.0f}, 0.0, 0, -2}), Error);
  EXPECT_THROW(run({{1.0f, 0, 1.0f}, 1.0, 0, -1}), Error);   // uniform outside [0, 1)
  EXPECT_THROW(run({{1.0f, 0, 0.0f}, 0.5, 0, -1}), Error);   // top_p
  EXPECT_THROW(run({{1.0f, -1, 1.0f}, 0.5, 0, -1}), Error);  // top_k
  std::vector<RowSample> two(2);
  const RowSampling ok{};
  EXPECT_THROW(sample_rows_cpu(std::span(&ok, 1), logits.data(), 2, 4, two), Error);  // result count
  EXPECT_NO_THROW(run({{0.0f, 0, 1.0f}, 7.0, 1, 3}));  // greedy ignores the uniform
}

}  // namespace
}  // namespace bg::ops

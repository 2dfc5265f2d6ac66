// Sampling: greedy argmax (ties, NaN), temperature 0 and top_k = 1 as greedy, seeded reproducibility, top-p and top-k
// cuts, empirical frequencies against softmax probabilities, and parameter checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

#include "core/error.h"
#include "ops/sampling/sampling.h"

namespace bg::ops {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(Sampling, ArgmaxTiesGoToTheLowestIndex) {
  const std::vector<float> a = {1.0f, 3.0f, 3.0f, 2.0f};
  EXPECT_EQ(argmax(a.data(), 4), 1);
  const std::vector<float> b = {5.0f, 1.0f, 5.0f};
  EXPECT_EQ(argmax(b.data(), 3), 0);
  const std::vector<float> c = {-kInf, -2.0f, 7.5f, -kInf, 7.5f};
  EXPECT_EQ(argmax(c.data(), 5), 2);
  const std::vector<float> d = {-3.0f, -1.0f, -2.0f};
  EXPECT_EQ(argmax(d.data(), 3), 1);
  EXPECT_EQ(argmax(d.data(), 1), 0);
}

TEST(Sampling, NanIsAnError) {
  const std::vector<float> a = {1.0f, kNaN, 0.0f};
  const std::vector<float> last = {1.0f, 2.0f, kNaN};
  EXPECT_THROW(argmax(a.data(), 3), Error);
  EXPECT_THROW(argmax(last.data(), 3), Error);
  std::mt19937_64 rng(1);
  EXPECT_THROW(sample_token({0.0f, 0, 1.0f}, a.data(), 3, rng), Error);
  EXPECT_THROW(sample_token({1.0f, 0, 1.0f}, a.data(), 3, rng), Error);
  EXPECT_THROW(sample_token({0.7f, 2, 0.9f}, last.data(), 3, rng), Error);
  EXPECT_THROW(argmax(a.data(), 0), Error);
}

TEST(Sampling, TemperatureZeroIsGreedyAndDrawsNothing) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f, 1.9f};
  for (uint64_t seed = 0; seed < 20; ++seed) {
    std::mt19937_64 rng(seed), untouched(seed);
    EXPECT_EQ(sample_token({0.0f, 0, 1.0f}, logits.data(), 5, rng), 1);
    EXPECT_EQ(sample_token({-1.0f, 3, 0.5f}, logits.data(), 5, rng), 1);
    EXPECT_EQ(rng, untouched);
  }
}

TEST(Sampling, NonGreedyAdvancesTheGeneratorByOneDraw) {
  const std::vector<float> logits = {0.5f, 2.0f, 1.0f, -1.0f, 1.9f};
  std::mt19937_64 rng(9), expected(9);
  sample_token({1.0f, 0, 1.0f}, logits.data(), 5, rng);
  expected.discard(1);
  EXPECT_EQ(rng, expected);
}

TEST(Sampling, TopKOneIsGreedyAtAnyTemperature) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f, 1.99f};
  for (float temperature : {0.1f, 1.0f, 5.0f, 1000.0f}) {
    std::mt19937_64 rng(static_cast<uint64_t>(temperature * 10));
    for (int i = 0; i < 200; ++i)
      ASSERT_EQ(sample_token({temperature, 1, 1.0f}, logits.data(), 5, rng), 1) << "temperature " << temperature;
  }
}

std::vector<int32_t> draw_sequence(const SamplingParams& p, const std::vector<float>& logits, uint64_t seed, int n) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(sample_token(p, logits.data(), static_cast<int64_t>(logits.size()), rng));
  return out;
}

TEST(Sampling, SameSeedSameSequenceDifferentSeedsDiffer) {
  const std::vector<float> logits = {0.1f, 0.2f, 0.0f, -0.1f, 0.15f};  // close to uniform
  const SamplingParams p{1.0f, 0, 1.0f};
  std::vector<int32_t> a = draw_sequence(p, logits, 7, 64), b = draw_sequence(p, logits, 7, 64);
  std::vector<int32_t> c = draw_sequence(p, logits, 8, 64);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Draws actually vary within a sequence.
  EXPECT_NE(std::count(a.begin(), a.end(), a[0]), static_cast<std::ptrdiff_t>(a.size()));
}

TEST(Sampling, SmallTopPDrawsOnlyTheTopCandidate) {
  const std::vector<float> logits = {0.1f, 2.0f, 1.0f, 1.9f, -0.5f};
  for (float top_p : {1e-6f, 0.01f, 0.2f}) {
    std::vector<int32_t> seq = draw_sequence({1.0f, 0, top_p}, logits, 3, 500);
    for (int32_t id : seq) ASSERT_EQ(id, 1) << "top_p " << top_p;
  }
}

// Counts of `n_draws` draws; each count must lie within 5 standard deviations of n * p.
void expect_frequencies(const SamplingParams& p, const std::vector<float>& logits, const std::vector<double>& probs,
                        uint64_t seed) {
  const int n_draws = 20000;
  std::vector<int32_t> seq = draw_sequence(p, logits, seed, n_draws);
  std::vector<int> counts(logits.size(), 0);
  for (int32_t id : seq) ++counts[static_cast<size_t>(id)];
  for (size_t i = 0; i < logits.size(); ++i) {
    double mean = n_draws * probs[i], sd = std::sqrt(n_draws * probs[i] * (1.0 - probs[i]));
    if (probs[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "id " << i;
    } else {
      EXPECT_NEAR(counts[i], mean, 5.0 * sd) << "id " << i << " p " << probs[i];
    }
  }
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature, const std::vector<bool>& keep) {
  std::vector<double> p(logits.size(), 0.0);
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (keep[i]) total += (p[i] = std::exp(logits[i] / temperature));
  }
  for (double& x : p) x /= total;
  return p;
}

const std::vector<float> kLogits = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f};

TEST(Sampling, FrequenciesMatchSoftmaxAtTemperatureOne) {
  std::vector<double> probs = softmax(kLogits, 1.0, std::vector<bool>(5, true));
  // p = {0.2014, 0.1222, 0.0549, 0.5475, 0.0741}: every entry is drawn often enough to be checked.
  expect_frequencies({1.0f, 0, 1.0f}, kLogits, probs, 11);
  expect_frequencies({1.0f, 5, 1.0f}, kLogits, probs, 12);  // top_k = vocab: no cut
}

TEST(Sampling, FrequenciesWithTemperatureTopKAndTopP) {
  // Temperature 2 flattens the distribution.
  expect_frequencies({2.0f, 0, 1.0f}, kLogits, softmax(kLogits, 2.0, std::vector<bool>(5, true)), 21);
  // top_k = 3 keeps ids 3, 0, 1 and renormalises over them.
  expect_frequencies({1.0f, 3, 1.0f}, kLogits, softmax(kLogits, 1.0, {true, true, false, true, false}), 22);
  // top_p = 0.7: id 3 (0.5475) alone is short of 0.7, with id 0 (0.7489) it reaches it: the smallest such prefix.
  expect_frequencies({1.0f, 0, 0.7f}, kLogits, softmax(kLogits, 1.0, {true, false, false, true, false}), 23);
  // top_p = 0.9: ids 3, 0, 1 reach 0.8710, id 4 brings 0.9451.
  expect_frequencies({1.0f, 0, 0.9f}, kLogits, softmax(kLogits, 1.0, {true, true, false, true, true}), 24);
  // top_k = 3 then top_p = 0.9 of the renormalised three (0.6285, 0.8598): ids 3, 0, 1 all kept.
  expect_frequencies({1.0f, 3, 0.9f}, kLogits, softmax(kLogits, 1.0, {true, true, false, true, false}), 25);
  // top_k = 3 then top_p = 0.8: ids 3, 0 (0.8598 >= 0.8).
  expect_frequencies({1.0f, 3, 0.8f}, kLogits, softmax(kLogits, 1.0, {true, false, false, true, false}), 26);
}

TEST(Sampling, SampleTokenIsWithUniformOfOneDraw) {
  const std::vector<SamplingParams> params = {{1.0f, 0, 1.0f}, {0.7f, 3, 1.0f}, {1.3f, 0, 0.8f}, {2.0f, 2, 0.5f}};
  for (const SamplingParams& p : params) {
    std::mt19937_64 rng(31), shadow(31);
    for (int i = 0; i < 300; ++i) {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(shadow);
      ASSERT_EQ(sample_token(p, kLogits.data(), 5, rng), sample_token_with_uniform(p, kLogits.data(), 5, u)) << i;
    }
    EXPECT_EQ(rng, shadow);
  }
}

TEST(Sampling, WithUniformWalksTheSortedCandidates) {
  // Sorted order of kLogits: ids 3 (2.0), 0 (1.0), 1 (0.5), 4 (0.0), 2 (-0.3); p = {.5475, .2014, .1222, .0741, .0549}.
  const SamplingParams all{1.0f, 0, 1.0f};
  EXPECT_EQ(sample_token_with_uniform(all, kLogits.data(), 5, 0.0), 3);
  EXPECT_EQ(sample_token_with_uniform(all, kLogits.data(), 5, 0.54), 3);
  EXPECT_EQ(sample_token_with_uniform(all, kLogits.data(), 5, 0.55), 0);
  EXPECT_EQ(sample_token_with_uniform(all, kLogits.data(), 5, 0.75), 1);
  EXPECT_EQ(sample_token_with_uniform(all, kLogits.data(), 5, 0.88), 4);
  EXPECT_EQ(sample_token_with_uniform(all, kLogits.data(), 5, std::nextafter(1.0, 0.0)), 2);
  // top_k = 2 renormalises over ids 3, 0 (0.7311, 0.2689); top_p = 0.7 keeps the same two.
  for (const SamplingParams& p : {SamplingParams{1.0f, 2, 1.0f}, SamplingParams{1.0f, 0, 0.7f}}) {
    EXPECT_EQ(sample_token_with_uniform(p, kLogits.data(), 5, 0.73), 3);
    EXPECT_EQ(sample_token_with_uniform(p, kLogits.data(), 5, 0.74), 0);
    EXPECT_EQ(sample_token_with_uniform(p, kLogits.data(), 5, std::nextafter(1.0, 0.0)), 0);
  }
  // Ties: equal logits go lower index first.
  const std::vector<float> tied = {1.0f, 2.0f, 1.0f, 2.0f};  // order 1, 3, 0, 2; p = {.3655, .3655, .1345, .1345}
  EXPECT_EQ(sample_token_with_uniform(all, tied.data(), 4, 0.30), 1);
  EXPECT_EQ(sample_token_with_uniform(all, tied.data(), 4, 0.40), 3);
  EXPECT_EQ(sample_token_with_uniform(all, tied.data(), 4, 0.80), 0);
  EXPECT_EQ(sample_token_with_uniform(all, tied.data(), 4, 0.90), 2);
  // Greedy ignores u.
  EXPECT_EQ(sample_token_with_uniform({0.0f, 0, 1.0f}, kLogits.data(), 5, 0.99), 3);
}

TEST(Sampling, WithUniformRejectsBadUniform) {
  for (double u : {-0.1, 1.0, 2.0, static_cast<double>(kNaN)})
    EXPECT_THROW(sample_token_with_uniform({1.0f, 0, 1.0f}, kLogits.data(), 5, u), Error) << "u " << u;
}

TEST(Sampling, RejectsBadTopPAndTopK) {
  std::mt19937_64 rng(1);
  for (float top_p : {0.0f, -0.1f, 1.5f, kNaN})
    EXPECT_THROW(sample_token({1.0f, 0, top_p}, kLogits.data(), 5, rng), Error) << "top_p " << top_p;
  EXPECT_THROW(sample_token({1.0f, -1, 1.0f}, kLogits.data(), 5, rng), Error);
  EXPECT_NO_THROW(sample_token({1.0f, 0, 1.0f}, kLogits.data(), 5, rng));
  EXPECT_NO_THROW(sample_token({1.0f, 100, 1.0f}, kLogits.data(), 5, rng));  // top_k past the vocabulary: all
}

}  // namespace
}  // namespace bg::ops

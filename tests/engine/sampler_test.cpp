// Sampling with logprobs: greedy, seeded reproducibility, logprobs against a direct log-softmax, stop rules, and the
// parameter checks at the worker's boundary.
#include <gtest/gtest.h>

#include <cmath>

#include "engine/sampler.h"

namespace bg::engine {
namespace {

TEST(Sampler, GreedyTakesTheArgmaxAndDrawsNothing) {
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f};
  proto::SamplingParams p;
  p.temperature = 0.0f;
  std::mt19937_64 rng(7), untouched(7);
  EXPECT_EQ(sample_next(p, logits.data(), 4, rng).token, 1);  // lowest id on ties
  EXPECT_EQ(rng(), untouched());
}

TEST(Sampler, SameSeedSameTokens) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(static_cast<double>(i)));
  proto::SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  p.top_k = 20;
  std::mt19937_64 a(123), b(123), c(124);
  std::vector<int32_t> ta, tb, tc;
  for (int i = 0; i < 20; ++i) {
    ta.push_back(sample_next(p, logits.data(), 50, a).token);
    tb.push_back(sample_next(p, logits.data(), 50, b).token);
    tc.push_back(sample_next(p, logits.data(), 50, c).token);
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
}

TEST(Sampler, LogprobsComeFromTheUnmodifiedDistribution) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.0f, 2.0f, -3.0f};
  double z = 0.0;
  for (float x : logits) z += std::exp(static_cast<double>(x));
  auto lp = [&](int i) { return static_cast<float>(logits[static_cast<size_t>(i)] - std::log(z)); };
  proto::SamplingParams p;
  p.temperature = 0.0f;
  p.top_logprobs = 3;
  std::mt19937_64 rng(0);
  Sampled s = sample_next(p, logits.data(), 5, rng);
  ASSERT_TRUE(s.logprob);
  EXPECT_EQ(s.logprob->token, 1);
  EXPECT_NEAR(s.logprob->logprob, lp(1), 1e-6);
  ASSERT_EQ(s.logprob->top.size(), 3u);
  EXPECT_EQ(s.logprob->top[0].first, 1);
  EXPECT_EQ(s.logprob->top[1].first, 3);
  EXPECT_EQ(s.logprob->top[2].first, 0);
  EXPECT_NEAR(s.logprob->top[2].second, lp(0), 1e-6);
  // Temperature and top-k change the choice, not the reported logprobs.
  p.temperature = 5.0f;
  p.top_k = 2;
  Sampled t = sample_next(p, logits.data(), 5, rng);
  EXPECT_TRUE(t.token == 1 || t.token == 3);
  EXPECT_NEAR(t.logprob->logprob, lp(t.token), 1e-6);
  p.top_logprobs = -1;
  EXPECT_FALSE(sample_next(p, logits.data(), 5, rng).logprob);
  p.top_logprobs = 0;
  Sampled u = sample_next(p, logits.data(), 5, rng);
  ASSERT_TRUE(u.logprob);
  EXPECT_TRUE(u.logprob->top.empty());
}

TEST(Sampler, FinishReasons) {
  proto::SamplingParams p;
  p.stop_token_ids = {7};
  EXPECT_EQ(finish_reason_after(p, 9, 9, 1, 10), "stop");
  EXPECT_EQ(finish_reason_after(p, 9, 7, 1, 10), "stop");
  EXPECT_EQ(finish_reason_after(p, 9, 3, 1, 10), "");
  EXPECT_EQ(finish_reason_after(p, 9, 3, 10, 10), "length");
  p.ignore_eos = true;
  EXPECT_EQ(finish_reason_after(p, 9, 9, 1, 10), "");
  EXPECT_EQ(finish_reason_after(p, 9, 7, 1, 10), "stop");  // stop_token_ids still apply
}

TEST(Sampler, ParameterChecks) {
  proto::SamplingParams p;
  EXPECT_EQ(validate_sampling(p, 100), "");
  p.temperature = -0.5f;
  EXPECT_NE(validate_sampling(p, 100).find("temperature"), std::string::npos);
  p = {};
  p.top_p = 0.0f;
  EXPECT_NE(validate_sampling(p, 100).find("top_p"), std::string::npos);
  p = {};
  p.top_k = -1;
  EXPECT_NE(validate_sampling(p, 100).find("top_k"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_NE(validate_sampling(p, 100).find("max_tokens"), std::string::npos);
  p = {};
  p.top_logprobs = 21;
  EXPECT_NE(validate_sampling(p, 100).find("top_logprobs"), std::string::npos);
  p = {};
  p.stop_token_ids = {100};
  EXPECT_NE(validate_sampling(p, 100).find("stop token id 100"), std::string::npos);
}

}  // namespace
}  // namespace bg::engine

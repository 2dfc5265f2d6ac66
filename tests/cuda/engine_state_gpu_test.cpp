// Where state lives does not change outputs on the GPU: the tiny random Kimi-K3 and DeepSeek-V3 through the engine on
// CUDA, with sequences offloaded to the host tier (pinned memory, copy stream) and restored vs never offloaded (the
// same steps on the same data: tokens and logprobs bit for bit), and with the prefix cache on vs off (the suffix
// prefills as a shorter piece, so GEMM shapes differ: the same greedy tokens wherever the reference's top two are
// not within 0.05 nats, logprobs within bf16 rounding). Skipped without a GPU.
#include <cmath>

#include "cuda/cuda_testing.h"
#include "engine/state_identity_testing.h"
#include "temp_dir.h"

namespace bg::testing {
namespace {

using Outputs = std::map<std::string, StateRunOutput>;

class EngineStateGpu : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { dir_ = std::make_unique<TempDir>(); }
  static void TearDownTestSuite() { dir_.reset(); }
  Outputs run(StateRunConfig c, kv::StateUsage* usage = nullptr) {
    c.device = "cuda";
    return run_state_workload(state_run_model(dir_->path(), GetParam()), c, usage);
  }
  static std::unique_ptr<TempDir> dir_;
};

std::unique_ptr<TempDir> EngineStateGpu::dir_;

// Greedy tokens equal up to the reference's first near tie (after it the continuations may rightly differ).
void expect_same_tokens(const Outputs& got, const Outputs& want, float logprob_tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [id, w] : want) {
    const StateRunOutput& g = got.at(id);
    ASSERT_EQ(g.tokens.size(), w.tokens.size()) << id;
    ASSERT_EQ(w.logprobs.size(), w.tokens.size()) << id;
    ASSERT_EQ(g.logprobs.size(), w.tokens.size()) << id;
    for (size_t i = 0; i < w.tokens.size(); ++i) {
      ASSERT_TRUE(std::isfinite(g.logprobs[i].logprob)) << id << " token " << i;
      const auto& top = w.logprobs[i].top;
      ASSERT_EQ(top.size(), 2u) << id;
      if (top[0].second - top[1].second < 0.05f) break;
      EXPECT_EQ(g.tokens[i], w.tokens[i]) << id << " token " << i;
      EXPECT_NEAR(g.logprobs[i].logprob, w.logprobs[i].logprob, logprob_tolerance) << id << " token " << i;
      if (g.tokens[i] != w.tokens[i]) break;
    }
  }
}

TEST_P(EngineStateGpu, OffloadedAndRestoredSequencesEqualRoomyOnes) {
  BG_REQUIRE_GPU();
  const Outputs roomy = run(StateRunConfig{});
  kv::StateUsage u;
  // 20 blocks of 16 tokens for two prompts of 130 and 151 tokens that grow by 24: the newer goes to the host tier.
  const Outputs tight = run(StateRunConfig{.kv_blocks = 20, .host_bytes = int64_t{64} << 20}, &u);
  EXPECT_GE(u.offloads, 1);
  EXPECT_EQ(u.restores, u.offloads);
  for (const auto& [id, w] : roomy) {
    EXPECT_EQ(tight.at(id).tokens, w.tokens) << id;
    ASSERT_EQ(tight.at(id).logprobs.size(), w.logprobs.size()) << id;
    for (size_t i = 0; i < w.logprobs.size(); ++i) {
      EXPECT_EQ(tight.at(id).logprobs[i].logprob, w.logprobs[i].logprob) << id << " token " << i;
    }
  }
}

TEST_P(EngineStateGpu, PrefixCacheOnGivesTheSameTokens) {
  BG_REQUIRE_GPU();
  const Outputs off = run(StateRunConfig{});
  kv::StateUsage u;
  const Outputs on = run(StateRunConfig{.prefix_cache = true}, &u);
  EXPECT_GT(u.cache_hit_tokens, 0);
  EXPECT_GT(on.at("t1.1").cached_tokens, 0);
  expect_same_tokens(on, off, 0.1f);
  const Outputs both = run(StateRunConfig{.prefix_cache = true, .kv_blocks = 20, .host_bytes = int64_t{64} << 20});
  expect_same_tokens(both, off, 0.1f);
}

INSTANTIATE_TEST_SUITE_P(Archs, EngineStateGpu, ::testing::Values("kimi_k3", "deepseek_v3"));

}  // namespace
}  // namespace bg::testing

// Outputs do not depend on where state lives: the tiny random Kimi-K3 (KDA + MLA) and DeepSeek-V3 on the CPU give
// bit-identical tokens and logprobs with and without the prefix cache, and with sequences preempted to the host tier
// and restored, for prompts sharing a 100-token prefix (it ends inside a 64-token KDA chunk and inside a 16-token
// block) and a second turn that extends the first.
#include <gtest/gtest.h>

#include <map>

#include "engine/state_identity_testing.h"
#include "temp_dir.h"

namespace bg::engine {
namespace {

using bg::testing::TempDir;

using Output = testing::StateRunOutput;
using Config = testing::StateRunConfig;

class StateIdentity : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { dir_ = std::make_unique<TempDir>(); }
  static void TearDownTestSuite() { dir_.reset(); }

  std::map<std::string, Output> run(const Config& c, kv::StateUsage* usage = nullptr) {
    return testing::run_state_workload(testing::state_run_model(dir_->path(), GetParam()), c, usage);
  }

  static void expect_identical(std::map<std::string, Output>& got, std::map<std::string, Output>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (auto& [id, w] : want) {
      const Output& g = got[id];
      EXPECT_EQ(g.tokens, w.tokens) << id;
      ASSERT_EQ(g.logprobs.size(), w.logprobs.size()) << id;
      for (size_t i = 0; i < w.logprobs.size(); ++i) {
        EXPECT_EQ(g.logprobs[i].logprob, w.logprobs[i].logprob) << id << " token " << i;  // bit for bit
        EXPECT_EQ(g.logprobs[i].top, w.logprobs[i].top) << id << " token " << i;
      }
    }
  }

  static std::unique_ptr<TempDir> dir_;
};

std::unique_ptr<TempDir> StateIdentity::dir_;

TEST_P(StateIdentity, PrefixCacheOnEqualsOffBitForBit) {
  auto off = run(Config{});
  kv::StateUsage u;
  auto on = run(Config{.prefix_cache = true}, &u);
  expect_identical(on, off);
  const bool kda = GetParam() == "kimi_k3";
  // Turn 1: the later prompts reuse the prefix (K3: up to the snapshot at 64; DeepSeek: all 100 tokens, the last
  // block copied). Turn 2: the first conversation's whole turn-1 prompt (K3: up to its last snapshot).
  EXPECT_EQ(on["t1.1"].cached_tokens, kda ? 64 : 100);
  EXPECT_EQ(on["t2.0"].cached_tokens, kda ? 64 : 109);
  EXPECT_EQ(off["t1.1"].cached_tokens, 0);
  EXPECT_GT(u.cache_hit_tokens, 0);
}

TEST_P(StateIdentity, OffloadedAndRestoredSequencesEqualRoomyOnes) {
  auto roomy = run(Config{});
  kv::StateUsage u;
  // 20 blocks of 16 tokens for two prompts of 130 and 151 tokens that grow by 24: decodes run out of blocks and the
  // newer request goes to the host tier and back.
  auto tight = run(Config{.kv_blocks = 20, .host_bytes = int64_t{64} << 20}, &u);
  expect_identical(tight, roomy);
  EXPECT_GE(u.offloads, 1);
  EXPECT_EQ(u.restores, u.offloads);
  auto both = run(Config{.prefix_cache = true, .kv_blocks = 20, .host_bytes = int64_t{64} << 20}, &u);
  expect_identical(both, roomy);
}

// --deterministic (the scheduler's fixed piece grid, cache hits rounded to it): still bit for bit, and the cache still
// saves prefill (DeepSeek's hit is rounded down to the 64-token grid).
TEST_P(StateIdentity, DeterministicPrefixCacheOnEqualsOffBitForBit) {
  auto off = run(Config{.deterministic = true});
  auto on = run(Config{.prefix_cache = true, .deterministic = true});
  expect_identical(on, off);
  auto plain = run(Config{});
  expect_identical(off, plain);  // the CPU backend is batch invariant anyway: the flag changes no bit there
  EXPECT_EQ(on["t1.1"].cached_tokens, 64);
  auto both = run(Config{.prefix_cache = true, .kv_blocks = 20, .host_bytes = int64_t{64} << 20, .deterministic = true});
  expect_identical(both, off);
}

INSTANTIATE_TEST_SUITE_P(Archs, StateIdentity, ::testing::Values("kimi_k3", "deepseek_v3"));

}  // namespace
}  // namespace bg::engine

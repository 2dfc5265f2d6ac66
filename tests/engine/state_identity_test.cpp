// Outputs do not depend on where state lives: the tiny random Kimi-K3 (KDA + MLA) and DeepSeek-V3 on the CPU give
// bit-identical tokens and logprobs with and without the prefix cache, and with sequences preempted to the host tier
// and restored, for prompts sharing a 100-token prefix (it ends inside a 64-token KDA chunk and inside a 16-token
// block) and a second turn that extends the first.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/engine.h"
#include "model/random_checkpoint.h"
#include "temp_dir.h"

namespace bg::engine {
namespace {

using bg::testing::TempDir;

struct Output {
  std::vector<int32_t> tokens;
  std::vector<proto::TokenLogprob> logprobs;
  int64_t cached_tokens = 0;
};

struct Config {
  bool prefix_cache = false;
  int64_t kv_blocks = 256;
  int64_t host_bytes = 0;
};

class StateIdentity : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { dir_ = std::make_unique<TempDir>(); }
  static void TearDownTestSuite() { dir_.reset(); }

  std::filesystem::path model_dir() {
    const std::filesystem::path p = *dir_ / GetParam();
    if (!std::filesystem::exists(p / "config.json")) {
      RandomCheckpointSpec spec;
      spec.arch = GetParam();
      spec.preset = "tiny";
      spec.seed = 7;
      spec.out_dir = p;
      write_random_checkpoint(spec);
    }
    return p;
  }

  // Turn 1: three prompts = the shared prefix + their own suffix (the first alone, then two together); turn 2: the
  // first conversation again with its reply and 20 new tokens.
  std::map<std::string, Output> run(const Config& c, kv::StateUsage* usage = nullptr) {
    auto model = load_model(model_dir());
    const int64_t V = model->info().vocab_size;
    kv::StatePlan plan;
    plan.kv_block_tokens = 16;
    plan.kv_blocks = c.kv_blocks;
    plan.state_slots = 4;
    plan.host_bytes = c.host_bytes;
    plan.prefix_cache = c.prefix_cache;
    plan.snapshot_interval = 64;
    Engine engine(std::move(model), plan, sched::SchedulerConfig{3, 512, 128, 64, 0.0});
    std::mt19937 rng(11);
    auto random_ids = [&](int n) {
      std::vector<int32_t> v(static_cast<size_t>(n));
      for (int32_t& t : v) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
      return v;
    };
    const std::vector<int32_t> prefix = random_ids(100);
    std::map<std::string, Output> out;
    std::map<std::string, std::vector<int32_t>> prompts;
    auto submit = [&](const std::string& id, const std::vector<int32_t>& prompt, int64_t max_tokens) {
      prompts[id] = prompt;
      proto::GenerateRequest g;
      g.id = id;
      g.prompt = prompt;
      g.params.temperature = 0.0f;
      g.params.max_tokens = max_tokens;
      g.params.ignore_eos = true;
      g.params.top_logprobs = 2;
      engine.submit(std::move(g));
    };
    auto drain = [&] {
      for (int i = 0; i < 2000 && engine.has_work(); ++i) {
        engine.step();
        for (const proto::TokenEvent& ev : engine.take_events()) {
          ASSERT_NE(ev.finish_reason, "error") << ev.error;
          Output& o = out[ev.id];
          o.tokens.insert(o.tokens.end(), ev.tokens.begin(), ev.tokens.end());
          o.logprobs.insert(o.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
          if (!ev.finish_reason.empty()) o.cached_tokens = ev.cached_tokens;
        }
      }
      ASSERT_FALSE(engine.has_work());
    };
    for (int i = 0; i < 3; ++i) {
      std::vector<int32_t> p = prefix;
      for (int32_t t : random_ids(9 + 21 * i)) p.push_back(t);
      submit(fmt::format("t1.{}", i), p, 24);
      if (i == 0) drain();  // the first fills the cache; the other two run together
    }
    drain();
    std::vector<int32_t> second = prompts["t1.0"];
    second.insert(second.end(), out["t1.0"].tokens.begin(), out["t1.0"].tokens.end());
    for (int32_t t : random_ids(20)) second.push_back(t);
    submit("t2.0", second, 8);
    drain();
    if (usage != nullptr) *usage = engine.state().usage();
    return out;
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

INSTANTIATE_TEST_SUITE_P(Archs, StateIdentity, ::testing::Values("kimi_k3", "deepseek_v3"));

}  // namespace
}  // namespace bg::engine

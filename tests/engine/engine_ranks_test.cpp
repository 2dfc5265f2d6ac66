// The engine as one rank of a CPU rank set (ranks as threads, tests/dist/rank_testing.h): each rank's engine owns
// its state manager, a TP follower runs its leader's layouts on its own pools, an idle rank takes part in every step
// with its pools (Model::sync_idle), and the requests' tokens equal one rank's. The step memory profile of a set runs
// as one collective: every rank gets the same need and the set still steps together afterwards.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "dist/comm.h"
#include "dist/rank_testing.h"
#include "engine/engine.h"
#include "engine/step_profile.h"
#include "model/random_checkpoint.h"
#include "temp_dir.h"

namespace bg::engine {
namespace {

using Outputs = std::map<std::string, std::vector<int32_t>>;

// Three greedy requests (two of them batched with a third arriving later) through an engine; the engine runs until
// they finish. `ranks` null: one rank.
Outputs run_requests(const std::filesystem::path& model_dir, std::shared_ptr<dist::RankContext> ranks) {
  auto model = load_model(model_dir, LoadOptions{.device = "cpu", .ranks = std::move(ranks)});
  const int64_t V = model->info().vocab_size;
  kv::StatePlan plan;
  plan.kv_block_tokens = 16;
  plan.kv_blocks = 128;
  plan.state_slots = 4;
  plan.prefix_cache = false;
  Engine engine(std::move(model), plan, sched::SchedulerConfig{3, 512, 128, 64, 0.0});
  std::mt19937 rng(5);
  auto submit = [&](const std::string& id, int n_prompt) {
    proto::GenerateRequest g;
    g.id = id;
    for (int i = 0; i < n_prompt; ++i) g.prompt.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(V)));
    g.params.temperature = 0.0f;
    g.params.max_tokens = 10;
    g.params.ignore_eos = true;
    engine.submit(std::move(g));
  };
  Outputs out;
  auto step = [&] {
    engine.step();
    for (const proto::TokenEvent& ev : engine.take_events()) {
      EXPECT_NE(ev.finish_reason, "error") << ev.error;
      out[ev.id].insert(out[ev.id].end(), ev.tokens.begin(), ev.tokens.end());
    }
  };
  submit("a", 70);
  submit("b", 33);
  for (int i = 0; i < 4; ++i) step();
  submit("c", 5);
  for (int i = 0; i < 500 && engine.has_work(); ++i) step();
  EXPECT_FALSE(engine.has_work());
  if (engine.model().collective()) engine.model().sync_idle(true, {});  // end the set
  return out;
}

// A rank without requests (a TP follower, or another DP group's leader): steps until rank 0 ends the set.
void idle_rank(const std::filesystem::path& model_dir, std::shared_ptr<dist::RankContext> ranks) {
  auto model = load_model(model_dir, LoadOptions{.device = "cpu", .ranks = std::move(ranks)});
  kv::StatePlan plan;
  plan.kv_block_tokens = 16;
  plan.kv_blocks = 128;
  plan.state_slots = 4;
  plan.prefix_cache = false;
  Engine engine(std::move(model), plan, sched::SchedulerConfig{3, 512, 128, 64, 0.0});
  EXPECT_THROW(
      for (int i = 0; i < 100000; ++i) engine.step(), dist::SetStopping);
}

class EngineRanks : public ::testing::TestWithParam<const char*> {};

// The tiny random checkpoint of `arch` under `tmp`.
RandomCheckpointSpec tiny_checkpoint(const testing::TempDir& tmp, const char* arch, uint64_t seed) {
  RandomCheckpointSpec spec;
  spec.arch = arch;
  spec.preset = "tiny";
  spec.seed = seed;
  spec.out_dir = tmp / "model";
  write_random_checkpoint(spec);
  return spec;
}

TEST_P(EngineRanks, TokensEqualOneRank) {
  testing::TempDir tmp;
  const RandomCheckpointSpec spec = tiny_checkpoint(tmp, GetParam(), 3);
  const Outputs one = run_requests(spec.out_dir, nullptr);
  ASSERT_EQ(one.size(), 3u);
  for (const auto& [tp, dp] : {std::pair{2, 1}, std::pair{1, 2}}) {
    dist::ParallelFlags flags;
    flags.tp = tp;
    flags.dp = dp;
    Outputs set;
    testing::run_ranks(
        dist::ParallelLayout::from_flags(flags),
        [&](dist::RankContext& ctx) {
          std::shared_ptr<dist::RankContext> ranks(std::shared_ptr<void>(), &ctx);  // not owned: lives for the call
          if (ctx.rank() == 0) {
            set = run_requests(spec.out_dir, ranks);
          } else {
            idle_rank(spec.out_dir, ranks);
          }
        },
        {.slot_bytes = size_t{1} << 20, .timeout_s = 120.0});
    EXPECT_EQ(set, one) << "--tp " << tp << " --dp " << dp;
  }
}

// The last-token logits of `prompt` on a fresh sequence (a leader of a set, or one rank); a TP follower (leader false)
// takes part in that step with its own pools.
std::vector<float> prefill_logits(Model& model, const std::vector<int32_t>& prompt, bool leader) {
  std::unique_ptr<kv::StateManager> state = make_state(model, 1, 64);
  std::vector<float> logits(static_cast<size_t>(model.info().vocab_size));
  if (!leader) {
    EXPECT_TRUE(model.sync_idle(false, state->step_pools()));
    return logits;
  }
  std::unique_ptr<Sequence> seq = state->new_sequence(64);
  const BatchEntry entry{seq.get(), std::span<const int32_t>(prompt)};
  model.forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
  return logits;
}

TEST_P(EngineRanks, TheStepProfileOfASetIsOneCollective) {
  testing::TempDir tmp;
  const RandomCheckpointSpec spec = tiny_checkpoint(tmp, GetParam(), 4);
  const std::vector<int32_t> prompt = {5, 17, 2, 40, 33, 8, 61};
  auto one = load_model(spec.out_dir, LoadOptions{.device = "cpu"});
  EXPECT_EQ(profile_step_memory(*one, nullptr, 32, 100, 40), 0) << "the CPU backend counts no device memory";
  const std::vector<float> want = prefill_logits(*one, prompt, true);
  dist::ParallelFlags flags;
  flags.tp = 2;
  flags.dp = 2;
  std::vector<int64_t> needs(4, -1);
  std::vector<std::vector<float>> got(4);
  testing::run_ranks(
      dist::ParallelLayout::from_flags(flags),
      [&](dist::RankContext& ctx) {
        std::shared_ptr<dist::RankContext> ranks(std::shared_ptr<void>(), &ctx);  // not owned: lives for the call
        auto model = load_model(spec.out_dir, LoadOptions{.device = "cpu", .ranks = ranks});
        // 100 tokens in steps of 32: four steps, run by the two DP leaders, joined by their TP followers.
        needs[static_cast<size_t>(ctx.rank())] = profile_step_memory(*model, ranks.get(), 32, 100, 40);
        got[static_cast<size_t>(ctx.rank())] = prefill_logits(*model, prompt, ctx.place.is_leader());
        std::unique_ptr<kv::StateManager> state = make_state(*model, 1, 16);
        EXPECT_FALSE(model->sync_idle(ctx.rank() == 0, state->step_pools())) << "rank 0 ends the set";
      },
      {.slot_bytes = size_t{1} << 20, .timeout_s = 60.0});
  EXPECT_EQ(needs, std::vector<int64_t>(4, 0));
  for (const int leader : {0, 2}) {
    ASSERT_EQ(got[static_cast<size_t>(leader)].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got[static_cast<size_t>(leader)][i], want[i], 1e-4) << "rank " << leader << ", logit " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, EngineRanks, ::testing::Values("kimi_k3", "deepseek_v3"));

}  // namespace
}  // namespace bg::engine

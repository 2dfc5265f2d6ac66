// One multi-turn workload through the real engine (tiny random checkpoint, any device) under a given state plan: the
// CPU test (tests/engine/state_identity_test.cpp) and the GPU test (tests/cuda/engine_state_gpu_test.cpp) compare its
// outputs with the prefix cache on and off and with sequences offloaded to the host tier and restored.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/random_checkpoint.h"

namespace bg::testing {

struct StateRunOutput {
  std::vector<int32_t> tokens;
  std::vector<proto::TokenLogprob> logprobs;
  int64_t cached_tokens = 0;
};

struct StateRunConfig {
  std::string device = "cpu";
  bool prefix_cache = false;
  int64_t kv_blocks = 256;  // of 16 tokens
  int64_t host_bytes = 0;
  bool deterministic = false;  // --deterministic: batch-invariant kernels, prefill pieces and cache hits on a grid
};

// The tiny random checkpoint of `arch` under `root` (written once).
inline std::filesystem::path state_run_model(const std::filesystem::path& root, const std::string& arch) {
  const std::filesystem::path p = root / arch;
  if (!std::filesystem::exists(p / "config.json")) {
    RandomCheckpointSpec spec;
    spec.arch = arch;
    spec.preset = "tiny";
    spec.seed = 7;
    spec.out_dir = p;
    write_random_checkpoint(spec);
  }
  return p;
}

// Turn 1: three prompts = a shared 100-token prefix (it ends inside a 64-token KDA chunk and inside a 16-token block)
// + their own suffix (the first alone, then two together); turn 2: the first conversation again with its reply and 20
// new tokens. Greedy, 2 top logprobs per token. Output by request id ("t1.0", "t1.1", "t1.2", "t2.0").
inline std::map<std::string, StateRunOutput> run_state_workload(const std::filesystem::path& model_dir,
                                                                const StateRunConfig& c,
                                                                kv::StateUsage* usage = nullptr) {
  auto model = load_model(model_dir, LoadOptions{.device = c.device, .deterministic = c.deterministic});
  const int64_t V = model->info().vocab_size;
  kv::StatePlan plan;
  plan.kv_block_tokens = 16;
  plan.kv_blocks = c.kv_blocks;
  plan.state_slots = 4;
  plan.host_bytes = c.host_bytes;
  plan.prefix_cache = c.prefix_cache;
  plan.snapshot_interval = 64;
  sched::SchedulerConfig sc{3, 512, 128, 64, 0.0};
  if (c.deterministic) {  // as the worker sets them for --deterministic
    sc.deterministic = true;
    plan.resume_align_tokens = plan.snapshot_interval;
  }
  engine::Engine engine(std::move(model), plan, sc);
  std::mt19937 rng(11);
  auto random_ids = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int32_t& t : v) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(V));
    return v;
  };
  const std::vector<int32_t> prefix = random_ids(100);
  std::map<std::string, StateRunOutput> out;
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
        StateRunOutput& o = out[ev.id];
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

}  // namespace bg::testing

// A checkpoint with one poisoned routed expert (make-random --poison-expert) served by the real Engine beside the
// same checkpoint clean: every request either fails alone with the non-finite-logits error or returns exactly the
// clean model's tokens, and both happen. Shared by the CPU test (tests/engine) and the GPU test (tests/cuda).
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "engine/engine.h"
#include "kv/state_manager.h"
#include "model/model.h"
#include "model/random_checkpoint.h"
#include "temp_dir.h"

namespace bg::testing {

struct PoisonOutcome {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  std::string error;
};

inline std::map<std::string, PoisonOutcome> run_poison_requests(const std::filesystem::path& model_dir,
                                                                 const std::string& device, int n_requests) {
  LoadOptions lo;
  lo.device = device;
  engine::Engine engine(load_model(model_dir, lo), kv::StatePlan::simple(n_requests, 64 * n_requests),
                        sched::SchedulerConfig{n_requests, 32, 256, 64, 0.0});
  for (int i = 0; i < n_requests; ++i) {
    proto::GenerateRequest g;
    g.id = fmt::format("r{}", i);
    g.prompt = {(7 + 37 * i) % 500, (11 + 53 * i) % 500, 5 + i};  // both tiny vocabularies hold 500 ids
    g.params.max_tokens = 4;
    g.params.temperature = 0.0f;
    g.params.ignore_eos = true;
    engine.submit(std::move(g));
  }
  std::map<std::string, PoisonOutcome> out;
  for (int step = 0; step < 200 && engine.has_work(); ++step) {
    engine.step();
    for (proto::TokenEvent& ev : engine.take_events()) {
      PoisonOutcome& o = out[ev.id];
      o.tokens.insert(o.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      if (!ev.finish_reason.empty()) o.finish_reason = ev.finish_reason;
      if (!ev.error.empty()) o.error = ev.error;
    }
  }
  EXPECT_FALSE(engine.has_work());
  return out;
}

// Writes `arch` tiny in bf16 (float weights can hold NaN) clean and with expert `poison` poisoned, runs both, checks.
inline void expect_poisoned_expert_contained(const std::string& arch, const std::string& device, ExpertRef poison) {
  TempDir tmp;
  RandomCheckpointSpec spec;
  spec.arch = arch;
  spec.preset = "tiny";
  spec.format = "bf16";
  spec.seed = 3;
  spec.out_dir = tmp.path() / "clean";
  write_random_checkpoint(spec);
  spec.out_dir = tmp.path() / "poisoned";
  spec.poison_experts = {poison};
  write_random_checkpoint(spec);

  const int n = 12;
  auto clean = run_poison_requests(tmp.path() / "clean", device, n);
  auto poisoned = run_poison_requests(tmp.path() / "poisoned", device, n);
  int n_failed = 0, n_same = 0;
  for (int i = 0; i < n; ++i) {
    const std::string id = fmt::format("r{}", i);
    ASSERT_EQ(clean[id].finish_reason, "length") << id << ": " << clean[id].error;
    const PoisonOutcome& p = poisoned[id];
    if (p.finish_reason == "error") {
      EXPECT_NE(p.error.find("non-finite"), std::string::npos) << id << ": " << p.error;
      ++n_failed;
    } else {
      EXPECT_EQ(p.finish_reason, "length") << id;
      EXPECT_EQ(p.tokens, clean[id].tokens) << id << ": completed with other tokens than the clean model";
      ++n_same;
    }
  }
  // Both cases happened: the poison reached some requests and spared others (else the test proves nothing).
  EXPECT_GT(n_failed, 0) << "no request reached the poisoned expert";
  EXPECT_GT(n_same, 0) << "every request failed: the fault was not contained to the routed requests";
}

}  // namespace bg::testing

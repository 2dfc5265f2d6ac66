// The engine's two sampling paths side by side: a borrowed model whose forward_batch_sample is either the model's own
// (Backend::sample_rows: on CUDA the logits stay on the device) or Model's default (logits to host memory, then
// ops::sample_rows_cpu: the CPU-sampling path). A workload of requests with fixed seeds and mixed sampling settings
// runs through the real engine on either; the CPU test (tests/engine/sampling_step_test.cpp) and the GPU test
// (tests/cuda/sampling_step_gpu_test.cpp) compare the served tokens and logprobs.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/random_checkpoint.h"

namespace bg::testing {

// Borrows `inner` (which must outlive it) so that two engines can run the same loaded model one after the other.
class BorrowedModel final : public Model {
 public:
  BorrowedModel(Model& inner, bool backend_sampling) : inner_(inner), backend_sampling_(backend_sampling) {}
  const ModelInfo& info() const override { return inner_.info(); }
  const StateGeometry& state_geometry() const override { return inner_.state_geometry(); }
  Backend& backend() const override { return inner_.backend(); }
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) override {
    inner_.forward(seq, tokens, logits, tap);
  }
  void forward_batch(std::span<const BatchEntry> batch, float* last_logits) override {
    inner_.forward_batch(batch, last_logits);
  }
  void forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                            std::span<ops::RowSample> out) override {
    if (backend_sampling_) {
      inner_.forward_batch_sample(batch, rows, out);
    } else {
      Model::forward_batch_sample(batch, rows, out);  // host logits + ops::sample_rows_cpu
    }
  }

 private:
  Model& inner_;
  bool backend_sampling_;
};

struct SampledOutput {
  std::vector<int32_t> tokens;
  std::vector<proto::TokenLogprob> logprobs;
};

// Six concurrent requests with fixed seeds: greedy, temperature, top-k, top-p (K3's 1.0 / 0.95, with 5 logprobs),
// top-k + top-p with 20 logprobs, and greedy with the token's logprob only; 10 new tokens each. By request id.
inline std::map<std::string, SampledOutput> run_sampling_workload(Model& model, bool backend_sampling) {
  const int64_t V = model.info().vocab_size;
  kv::StatePlan plan = kv::StatePlan::simple(8, 8 * 96);
  engine::Engine engine(std::make_unique<BorrowedModel>(model, backend_sampling), plan,
                        sched::SchedulerConfig{8, 96, 256, 64, 0.0});
  struct Setting {
    float temperature;
    int64_t top_k;
    float top_p;
    int32_t top_logprobs;
  };
  const std::vector<Setting> settings = {{0.0f, 0, 1.0f, -1}, {0.8f, 0, 1.0f, -1}, {1.0f, 20, 1.0f, 2},
                                         {1.0f, 0, 0.95f, 5}, {1.3f, 50, 0.8f, 20}, {0.0f, 0, 1.0f, 0}};
  for (size_t i = 0; i < settings.size(); ++i) {
    proto::GenerateRequest g;
    g.id = "r" + std::to_string(i);
    for (int t = 0; t < 5 + 3 * static_cast<int>(i); ++t) {
      g.prompt.push_back(static_cast<int32_t>((t * 131 + 17 * static_cast<int>(i)) % V));
    }
    g.params.temperature = settings[i].temperature;
    g.params.top_k = static_cast<int32_t>(settings[i].top_k);
    g.params.top_p = settings[i].top_p;
    g.params.top_logprobs = settings[i].top_logprobs;
    g.params.seed = 1000 + i;
    g.params.max_tokens = 10;
    g.params.ignore_eos = true;
    engine.submit(std::move(g));
  }
  std::map<std::string, SampledOutput> out;
  for (int i = 0; i < 500 && engine.has_work(); ++i) {
    engine.step();
    for (const proto::TokenEvent& ev : engine.take_events()) {
      EXPECT_NE(ev.finish_reason, "error") << ev.id << ": " << ev.error;
      SampledOutput& o = out[ev.id];
      o.tokens.insert(o.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      o.logprobs.insert(o.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
    }
  }
  EXPECT_FALSE(engine.has_work());
  return out;
}

// Same tokens; logprobs and their alternatives equal within `tolerance` (0: bit for bit).
inline void expect_same_samples(const std::map<std::string, SampledOutput>& got,
                                const std::map<std::string, SampledOutput>& want, float tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [id, w] : want) {
    const SampledOutput& g = got.at(id);
    EXPECT_EQ(g.tokens, w.tokens) << id;
    EXPECT_EQ(w.tokens.size(), 10u) << id;
    ASSERT_EQ(g.logprobs.size(), w.logprobs.size()) << id;
    for (size_t i = 0; i < w.logprobs.size(); ++i) {
      EXPECT_EQ(g.logprobs[i].token, w.logprobs[i].token) << id << " token " << i;
      EXPECT_NEAR(g.logprobs[i].logprob, w.logprobs[i].logprob, tolerance) << id << " token " << i;
      ASSERT_EQ(g.logprobs[i].top.size(), w.logprobs[i].top.size()) << id << " token " << i;
      for (size_t k = 0; k < w.logprobs[i].top.size(); ++k) {
        EXPECT_EQ(g.logprobs[i].top[k].first, w.logprobs[i].top[k].first) << id << " token " << i << " alt " << k;
        EXPECT_NEAR(g.logprobs[i].top[k].second, w.logprobs[i].top[k].second, tolerance) << id << " token " << i;
      }
    }
  }
}

// The tiny random checkpoint of `arch` under `root` (written once).
inline std::filesystem::path sampling_model(const std::filesystem::path& root, const std::string& arch) {
  const std::filesystem::path p = root / arch;
  if (!std::filesystem::exists(p / "config.json")) {
    RandomCheckpointSpec spec;
    spec.arch = arch;
    spec.preset = "tiny";
    spec.seed = 3;
    spec.out_dir = p;
    write_random_checkpoint(spec);
  }
  return p;
}

}  // namespace bg::testing

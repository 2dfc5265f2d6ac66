// Every golden case with a fraction of the experts streamed (--resident-experts 0 and 0.5; 1 is every other golden
// test): the reference logits within 1e-4, and the very logits of the all-resident model, bit for bit (the pool
// holds copies of the same bytes). The pool's counters show the experts really were copied in.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <tuple>

#include "engine/engine.h"
#include "golden/golden_runner.h"
#include "model/model_testing.h"
#include "model/step_model.h"

namespace bg::testing {
namespace {

class StreamedExpertsGolden : public ::testing::TestWithParam<std::tuple<std::string, double>> {};

TEST_P(StreamedExpertsGolden, MatchesReferenceAndTheResidentModel) {
  const auto& [name, fraction] = GetParam();
  GoldenCase gc(golden_dir() / name);
  LoadOptions streamed_options;
  streamed_options.resident_experts = fraction;
  auto streamed = load_model(gc.model_dir(), streamed_options);
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    const GoldenReport rep = check_prefill_and_decode(*streamed, gc.prompt(i));
    std::printf("%s, %.2f of the experts resident, prompt %ld: max rel err prefill %.3g decode %.3g\n", name.c_str(),
                fraction, static_cast<long>(i), rep.max_prefill_err, rep.max_decode_err);
  }
  const auto* step_model = dynamic_cast<const StepModel*>(streamed.get());
  ASSERT_NE(step_model, nullptr);
  ASSERT_NE(step_model->expert_stream(), nullptr) << "a fraction below 1 streams";
  const moe::ExpertStream::Stats stats = step_model->expert_stream()->stats();
  EXPECT_GT(stats.copies, 0u);
  EXPECT_EQ(streamed->expert_stream_counters().copies, static_cast<int64_t>(stats.copies));
  EXPECT_GT(stats.bytes_copied, 0u);
  std::printf("%s: %lu expert copies (%.2f MB), %lu pool hits, %ld buffers\n", name.c_str(),
              static_cast<unsigned long>(stats.copies), static_cast<double>(stats.bytes_copied) / 1e6,
              static_cast<unsigned long>(stats.hits), static_cast<long>(step_model->expert_stream()->n_buffers()));

  auto resident = load_model(gc.model_dir());
  const GoldenPrompt p = gc.prompt(gc.n_prompts() - 1);
  const EngineRun a = run_prefill_then_decode(*streamed, p.prompt, 4);
  const EngineRun b = run_prefill_then_decode(*resident, p.prompt, 4);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.logits, b.logits) << "bit-identical: streamed experts are copies of the same bytes";
}

// The engine reports the pool's counters in its status (the worker's /metrics lines batchgen_expert_*).
TEST(StreamedExpertsEngine, StatusCountsTheCopies) {
  GoldenCase gc(golden_dir() / "kimi_k3" / "k3-tiny");
  LoadOptions lo;
  lo.resident_experts = 0.25;
  engine::Engine engine(load_model(gc.model_dir(), lo), kv::StatePlan::simple(2, 128),
                        sched::SchedulerConfig{2, 32, 256, 64, 0.0});
  proto::WorkerStatus before;
  engine.fill_status(before);
  EXPECT_EQ(before.expert_copies_total, 0);
  proto::GenerateRequest g;
  g.id = "r";
  g.prompt = gc.prompt(0).prompt;
  g.params.max_tokens = 3;
  g.params.temperature = 0.0f;
  g.params.ignore_eos = true;
  engine.submit(std::move(g));
  for (int step = 0; step < 100 && engine.has_work(); ++step) {
    engine.step();
    engine.take_events();
  }
  proto::WorkerStatus after;
  engine.fill_status(after);
  EXPECT_GT(after.expert_copies_total, 0);
  EXPECT_GT(after.expert_bytes_copied_total, after.expert_copies_total);
  // Decode steps route much as the step before: the next layer's experts are copied ahead and used.
  EXPECT_GT(after.expert_prefetches_total, 0);
  EXPECT_GT(after.expert_prefetch_hits_total, 0);
  EXPECT_LE(after.expert_prefetch_hits_total, after.expert_prefetches_total);
}

INSTANTIATE_TEST_SUITE_P(Cases, StreamedExpertsGolden,
                         ::testing::Combine(::testing::Values("deepseek_v3/tiny-fp32", "deepseek_v3/tiny-fp8",
                                                              "deepseek_v3/tiny-mxfp4", "kimi_k3/k3-tiny",
                                                              "kimi_k3/k3-tiny-long"),
                                            ::testing::Values(0.0, 0.5)),
                         [](const auto& param_info) {
                           std::string s = std::get<0>(param_info.param);
                           for (char& c : s) c = (c == '/' || c == '-') ? '_' : c;
                           return s + (std::get<1>(param_info.param) == 0.0 ? "_resident0" : "_resident0_5");
                         });

}  // namespace
}  // namespace bg::testing

// The engine's step sampling on the CPU backend (Model::forward_batch_sample -> Backend::sample_rows) serves the
// same tokens and logprobs, bit for bit, as the CPU-sampling path over downloaded logits, for fixed seeds and mixed
// settings of six concurrent requests (each drawing from its own seeded generator).
#include <gtest/gtest.h>

#include "engine/sampling_step_testing.h"
#include "temp_dir.h"

namespace bg::testing {
namespace {

class SamplingStep : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { dir_ = std::make_unique<TempDir>(); }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::unique_ptr<TempDir> dir_;
};

std::unique_ptr<TempDir> SamplingStep::dir_;

TEST_P(SamplingStep, BackendSamplingEqualsTheHostLogitsPath) {
  auto model = load_model(sampling_model(dir_->path(), GetParam()), LoadOptions{.device = "cpu"});
  const auto on_backend = run_sampling_workload(*model, true);
  const auto on_host = run_sampling_workload(*model, false);
  expect_same_samples(on_backend, on_host, 0.0f);
  // Sampled settings really drew: the seeded requests differ from greedy somewhere.
  EXPECT_NE(on_backend.at("r1").tokens, on_backend.at("r0").tokens);
}

INSTANTIATE_TEST_SUITE_P(Archs, SamplingStep, ::testing::Values("kimi_k3", "deepseek_v3"));

}  // namespace
}  // namespace bg::testing

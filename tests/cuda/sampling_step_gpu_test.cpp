// One step's sampling on the GPU (CudaBackend::sample_rows: the logits stay on the device, rows up and results down
// through the backend's pinned buffers) against the CPU sampler (ops::sample_rows_cpu) on the same logits: greedy,
// temperature, top-k, top-p, mixed rows, a NaN row, an Inf row and logprobs rows, over vocabularies up to Kimi's
// 163840, rows read out of order and twice; and the engine on the tiny random models serving the same tokens and
// logprobs for fixed seeds through the GPU sampling path as through the CPU-sampling path. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"
#include "cuda/cuda_testing.h"
#include "engine/sampling_step_testing.h"
#include "temp_dir.h"

namespace bg::testing {
namespace {

using ops::RowSample;
using ops::RowSampling;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

void expect_same_sample(const RowSample& got, const RowSample& want, size_t i) {
  EXPECT_EQ(got.finite, want.finite) << "entry " << i;
  EXPECT_EQ(got.token, want.token) << "entry " << i;
  ASSERT_EQ(got.n_top, want.n_top) << "entry " << i;
  if (!want.finite) return;
  EXPECT_TRUE(std::isfinite(got.logprob)) << "entry " << i;
  EXPECT_NEAR(got.logprob, want.logprob, 1e-5f * std::max(1.0f, std::fabs(want.logprob))) << "entry " << i;
  for (int32_t k = 0; k < want.n_top; ++k) {
    EXPECT_EQ(got.top_ids[k], want.top_ids[k]) << "entry " << i << " alternative " << k;
    EXPECT_NEAR(got.top_logprobs[k], want.top_logprobs[k], 1e-5f * std::max(1.0f, std::fabs(want.top_logprobs[k])))
        << "entry " << i << " alternative " << k;
  }
}

// 12 logits rows (row 9 has a NaN, row 10 an Inf, row 11 is heavily tied) and 16 entries over them.
void check_vocab(Backend& be, int64_t vocab, uint64_t seed) {
  constexpr int64_t kRows = 12;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(static_cast<size_t>(kRows * vocab));
  for (float& v : logits) v = normal(rng);
  for (int64_t i = 0; i < vocab; ++i) logits[static_cast<size_t>(11 * vocab + i)] = std::round(normal(rng)) * 0.5f;
  logits[static_cast<size_t>(9 * vocab + vocab / 2)] = kNaN;
  logits[static_cast<size_t>(10 * vocab + vocab - 1)] = kInf;
  auto u = [&] { return ops::draw_uniform(rng); };
  const std::vector<RowSampling> rows = {
      {{0.0f, 0, 1.0f}, 0.0, 0, -1},      // greedy
      {{0.8f, 0, 1.0f}, u(), 1, -1},      // temperature
      {{1.0f, 40, 1.0f}, u(), 2, -1},     // top-k
      {{1.0f, 0, 0.95f}, u(), 3, -1},     // top-p (K3's setting)
      {{0.7f, 100, 0.9f}, u(), 4, 5},     // top-k + top-p, 5 logprobs
      {{1.0f, 0, 1e-6f}, u(), 5, 20},     // top-p keeping one candidate, 20 logprobs
      {{0.0f, 0, 1.0f}, 0.0, 6, 0},       // greedy, the token's logprob only
      {{2.0f, 1, 1.0f}, u(), 7, 3},       // top_k 1 at a high temperature
      {{1.5f, 0, 0.5f}, u(), 8, -1},
      {{0.0f, 0, 1.0f}, 0.0, 9, 5},       // NaN row
      {{1.0f, 0, 0.95f}, u(), 10, 5},     // Inf row
      {{1.0f, 0, 0.95f}, u(), 11, 20},    // tied logits: ties by index in the pick and the alternatives
      {{0.0f, 0, 1.0f}, 0.0, 11, 20},
      {{1.0f, 0, 0.95f}, u(), 3, 2},      // row 3 again, another draw
      {{1.0f, 1 << 30, 1.0f}, u(), 0, -1},
      {{0.0f, 0, 1.0f}, 0.0, 2, -1},
  };
  const Tensor d_logits = be.upload_f32(logits, {kRows, vocab}, DType::kF32);
  std::vector<RowSample> got(rows.size()), want(rows.size());
  for (RowSample& g : got) g.token = -7;  // poisoned: every entry must be written
  be.sample_rows(d_logits, rows, got);
  ops::sample_rows_cpu(rows, logits.data(), kRows, vocab, want);
  for (size_t i = 0; i < rows.size(); ++i) expect_same_sample(got[i], want[i], i);
  EXPECT_FALSE(got[9].finite);
  EXPECT_FALSE(got[10].finite);
  // Deterministic: the same inputs give the same results.
  std::vector<RowSample> again(rows.size());
  be.sample_rows(d_logits, rows, again);
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(again[i].token, got[i].token) << i;
  // No rows (a step that only prefills) still synchronises and returns nothing.
  be.sample_rows(d_logits, {}, {});
}

TEST(SamplingStepGpu, BackendSampleRowsMatchesTheCpuSampler) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  check_vocab(*be, 7, 1);
  check_vocab(*be, 1000, 2);
  check_vocab(*be, 163840, 3);
}

// Rows whose top-k or n-best window (bounded from the mass histogram, plan_row) cannot be used: a peaked row (one
// logit 60 nats above the rest, so every other weight is 0 and the bound never reaches k or n: the window is the whole
// row, too many to gather) and a flat row (every logit in bin 0). Both go through exact counts from a pass over the row
// (count_pass); the ids and logprobs still equal the CPU's.
TEST(SamplingStepGpu, UnusableWindowsFallBackToExactCounts) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  constexpr int64_t kVocab = 163840;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(2 * kVocab), 0.25f);  // row 1: flat
  for (int64_t i = 0; i < kVocab; ++i) logits[static_cast<size_t>(i)] = normal(rng);
  logits[777] = 60.0f;  // row 0: peaked
  auto u = [&] { return ops::draw_uniform(rng); };
  std::vector<RowSampling> rows;
  for (int32_t row : {0, 1}) {
    rows.push_back({{1.0f, 50, 1.0f}, u(), row, -1});   // top-k
    rows.push_back({{0.7f, 50, 0.9f}, u(), row, 20});   // top-k + top-p, 20 logprobs
    rows.push_back({{1.0f, 0, 0.95f}, u(), row, 20});   // top-p, 20 logprobs
    rows.push_back({{0.0f, 0, 1.0f}, 0.0, row, 20});    // greedy, 20 logprobs
    rows.push_back({{1.0f, 3000, 0.5f}, u(), row, 7});  // a k past what shared memory sorts
  }
  const Tensor d_logits = be->upload_f32(logits, {2, kVocab}, DType::kF32);
  std::vector<RowSample> got(rows.size()), want(rows.size());
  for (RowSample& g : got) g.token = -7;
  be->sample_rows(d_logits, rows, got);
  ops::sample_rows_cpu(rows, logits.data(), 2, kVocab, want);
  for (size_t i = 0; i < rows.size(); ++i) expect_same_sample(got[i], want[i], i);
  EXPECT_EQ(got[3].token, 777);
  EXPECT_EQ(got[3].top_ids[0], 777);
}

TEST(SamplingStepGpu, BadRowsAreErrors) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  const Tensor d_logits = be->upload_f32(std::vector<float>(20, 0.0f), {2, 10}, DType::kF32);
  std::vector<RowSample> out(1);
  const RowSampling out_of_range{{0.0f, 0, 1.0f}, 0.0, 2, -1};
  EXPECT_THROW(be->sample_rows(d_logits, std::span(&out_of_range, 1), out), Error);
  const RowSampling bad_uniform{{1.0f, 0, 1.0f}, 1.5, 0, -1};
  EXPECT_THROW(be->sample_rows(d_logits, std::span(&bad_uniform, 1), out), Error);
  const RowSampling ok{{0.0f, 0, 1.0f}, 0.0, 1, 2};
  be->sample_rows(d_logits, std::span(&ok, 1), out);  // the backend is still usable
  EXPECT_EQ(out[0].token, 0);
  EXPECT_EQ(out[0].n_top, 2);
}

class SamplingStepGpuEngine : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { dir_ = std::make_unique<TempDir>(); }
  static void TearDownTestSuite() { dir_.reset(); }
  static std::unique_ptr<TempDir> dir_;
};

std::unique_ptr<TempDir> SamplingStepGpuEngine::dir_;

// The same loaded model (so the same logits) through both paths: the tokens are equal, the logprobs within the
// rounding of log Z summed in another order.
TEST_P(SamplingStepGpuEngine, ServedTokensEqualTheCpuSamplingPath) {
  BG_REQUIRE_GPU();
  auto model = load_model(sampling_model(dir_->path(), GetParam()), LoadOptions{.device = "cuda"});
  const auto on_gpu = run_sampling_workload(*model, true);
  const auto on_cpu = run_sampling_workload(*model, false);
  expect_same_samples(on_gpu, on_cpu, 2e-5f);
}

INSTANTIATE_TEST_SUITE_P(Archs, SamplingStepGpuEngine, ::testing::Values("kimi_k3", "deepseek_v3"));

}  // namespace
}  // namespace bg::testing

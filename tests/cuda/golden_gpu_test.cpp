// The golden cases of both architectures on the CUDA backend (bf16 activations, fp32 accumulation and state): every
// logit row within the bf16 bound below, greedy agreement on every row whose reference top-1/top-2 margin exceeds
// twice the bound (relative to the row's max |logit|).
#include <gtest/gtest.h>

#include "cuda/cuda_testing.h"
#include "model/model.h"
#include "golden/golden_util.h"

namespace bg::testing {
namespace {

// Max relative error per logit row (||d||_inf / ||ref||_inf) the bf16 GPU path must stay within.
constexpr double kGpuLogitBound = 2e-2;

struct GpuCase {
  std::string arch;
  std::string name;
};

class GoldenGpu : public ::testing::TestWithParam<GpuCase> {};

TEST_P(GoldenGpu, PrefillAndDecodeWithinBf16Bound) {
  BG_REQUIRE_GPU();
  GoldenCase gc(golden_dir() / GetParam().arch / GetParam().name);
  auto model = load_model(gc.model_dir(), LoadOptions{.max_sequences = 2, .max_total_tokens = 4096, .device = "cuda"});
  const int64_t V = model->info().vocab_size;
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    GoldenPrompt g = gc.prompt(i);
    const int64_t L = static_cast<int64_t>(g.prompt.size()), total = static_cast<int64_t>(g.tokens.size());
    auto seq = model->new_sequence();
    std::vector<float> logits(static_cast<size_t>(total * V));
    model->forward(*seq, g.prompt, logits.data());
    for (int64_t t = L; t < total; ++t) {
      model->forward(*seq, std::span<const int32_t>(&g.tokens[static_cast<size_t>(t)], 1), logits.data() + t * V);
    }
    double worst = 0.0;
    int64_t greedy_checked = 0;
    for (int64_t t = 0; t < total; ++t) {
      const float* ref = g.logits.data() + t * V;
      const float* got = logits.data() + t * V;
      double err = row_rel_error(got, ref, V);
      worst = std::max(worst, err);
      EXPECT_LE(err, kGpuLogitBound) << GetParam().name << " prompt " << i << " row " << t;
      double ref_max = 0.0;
      for (int64_t j = 0; j < V; ++j) ref_max = std::max(ref_max, std::fabs(static_cast<double>(ref[j])));
      if (g.margin[static_cast<size_t>(t)] > 2.0 * kGpuLogitBound * ref_max) {
        ++greedy_checked;
        EXPECT_EQ(argmax_row(got, V), argmax_row(ref, V)) << GetParam().name << " prompt " << i << " row " << t;
      }
    }
    std::printf("[gpu golden] %s/%s prompt %ld: max rel err %.3e (bound %.0e), greedy checked on %ld of %ld rows\n",
                GetParam().arch.c_str(), GetParam().name.c_str(), static_cast<long>(i), worst, kGpuLogitBound,
                static_cast<long>(greedy_checked), static_cast<long>(total));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenGpu,
                         ::testing::Values(GpuCase{"deepseek_v3", "tiny-fp32"}, GpuCase{"deepseek_v3", "tiny-mxfp4"},
                                           GpuCase{"deepseek_v3", "tiny-fp8"}, GpuCase{"kimi_k3", "k3-tiny"},
                                           GpuCase{"kimi_k3", "k3-tiny-long"}),
                         [](const auto& param_info) {
                           std::string s = param_info.param.name;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace bg::testing

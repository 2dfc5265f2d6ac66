// DeepSeek-V3 golden cases (shared/golden/deepseek_v3): fp32, MXFP4 experts, FP8 block weights.
#include <gtest/gtest.h>

#include "golden/golden_runner.h"

namespace bg::testing {
namespace {

class DeepseekGolden : public ::testing::TestWithParam<std::string> {
 protected:
  std::filesystem::path case_dir() const { return golden_dir() / "deepseek_v3" / GetParam(); }
};

TEST_P(DeepseekGolden, PrefillAndDecodeMatchReference) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  ASSERT_GT(gc.n_prompts(), 0);
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    GoldenReport rep = check_prefill_and_decode(*model, gc.prompt(i));
    RecordProperty("prompt" + std::to_string(i) + "_max_err",
                   std::to_string(std::max(rep.max_prefill_err, rep.max_decode_err)));
    std::printf("%s prompt %ld: max rel err prefill %.3g decode %.3g\n", GetParam().c_str(), static_cast<long>(i),
                rep.max_prefill_err, rep.max_decode_err);
  }
}

TEST_P(DeepseekGolden, GreedyGenerationMatchesReference) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  for (int64_t i = 0; i < gc.n_prompts(); ++i) check_greedy_generation(*model, gc.prompt(i));
}

TEST_P(DeepseekGolden, SplitPrefillEqualsOnePrefill) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  GoldenPrompt g = gc.prompt(gc.n_prompts() - 1);
  for (int64_t cut : {int64_t{1}, static_cast<int64_t>(g.tokens.size()) / 2, static_cast<int64_t>(g.tokens.size()) - 1}) {
    check_split_prefill(*model, g, cut);
  }
}

TEST_P(DeepseekGolden, HiddenStatesPerLayer) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  GoldenPrompt g = gc.prompt(0);
  const int64_t n_layers = model->info().n_layers, H = model->info().hidden_size;
  std::vector<std::vector<float>> got(static_cast<size_t>(n_layers + 1));
  TapFn tap = [&](std::string_view name, int64_t layer, const float* data, int64_t n, int64_t dim) {
    // HF reports embeddings, layers 1..n-1, and the final norm output in place of the last layer.
    bool wanted = name == "embed" || name == "final_norm" || (name == "layer" && layer < n_layers);
    if (wanted) got[static_cast<size_t>(layer)].assign(data, data + n * dim);
  };
  auto state = make_state(*model, 1, static_cast<int64_t>(g.tokens.size()));
  auto seq = state->new_sequence(static_cast<int64_t>(g.tokens.size()));
  std::vector<float> logits(g.tokens.size() * static_cast<size_t>(model->info().vocab_size));
  model->forward(*seq, g.tokens, logits.data(), &tap);
  for (int64_t l = 0; l <= n_layers; ++l) {
    std::vector<float> ref = gc.view("hidden.0." + std::to_string(l)).to_f32();
    ASSERT_EQ(ref.size(), got[static_cast<size_t>(l)].size()) << "layer " << l;
    double worst = 0.0;
    for (size_t t = 0; t < g.tokens.size(); ++t) {
      worst = std::max(worst, row_rel_error(got[static_cast<size_t>(l)].data() + t * H, ref.data() + t * H, H));
    }
    EXPECT_LE(worst, kLogitTolerance) << "hidden state after layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, DeepseekGolden, ::testing::Values("tiny-fp32", "tiny-mxfp4", "tiny-fp8"),
                         [](const auto& param_info) {
                           std::string s = param_info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace bg::testing

// Kimi-K3 golden cases (shared/golden/kimi_k3): KDA + gated NoPE MLA + latent MoE + SiTU + Attention Residuals,
// computed by the official modeling code in float64.
#include <gtest/gtest.h>

#include <map>

#include "golden/golden_runner.h"

namespace bg::testing {
namespace {

class KimiK3Golden : public ::testing::TestWithParam<std::string> {
 protected:
  std::filesystem::path case_dir() const { return golden_dir() / "kimi_k3" / GetParam(); }
};

TEST_P(KimiK3Golden, PrefillAndDecodeMatchReference) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  ASSERT_GT(gc.n_prompts(), 0);
  for (int64_t i = 0; i < gc.n_prompts(); ++i) {
    GoldenReport rep = check_prefill_and_decode(*model, gc.prompt(i));
    std::printf("%s prompt %ld: max rel err prefill %.3g decode %.3g\n", GetParam().c_str(), static_cast<long>(i),
                rep.max_prefill_err, rep.max_decode_err);
  }
}

TEST_P(KimiK3Golden, GreedyGenerationMatchesReference) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  for (int64_t i = 0; i < gc.n_prompts(); ++i) check_greedy_generation(*model, gc.prompt(i));
}

// Splits inside and at the edges of 64-token KDA chunks, and at block boundaries of the cache.
TEST_P(KimiK3Golden, SplitPrefillEqualsOnePrefill) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  GoldenPrompt g = gc.prompt(gc.n_prompts() - 1);
  const int64_t n = static_cast<int64_t>(g.tokens.size());
  for (int64_t cut : {int64_t{1}, int64_t{2}, int64_t{37}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{130}, n - 1}) {
    if (cut > 0 && cut < n) check_split_prefill(*model, g, cut);
  }
}

TEST_P(KimiK3Golden, HiddenStatesPerLayer) {
  GoldenCase gc(case_dir());
  auto model = load_model(gc.model_dir());
  GoldenPrompt g = gc.prompt(0);
  const int64_t n_layers = model->info().n_layers, H = model->info().hidden_size;
  std::map<std::string, std::vector<float>> got;
  TapFn tap = [&](std::string_view name, int64_t layer, const float* data, int64_t n, int64_t dim) {
    std::string key = name == "embed" ? "hidden.0.0"
                      : name == "layer" ? "hidden.0." + std::to_string(layer)
                                        : std::string(name) + ".0";
    got[key].assign(data, data + n * dim);
  };
  auto state = make_state(*model, 1, static_cast<int64_t>(g.tokens.size()));
  auto seq = state->new_sequence(static_cast<int64_t>(g.tokens.size()));
  std::vector<float> logits(g.tokens.size() * static_cast<size_t>(model->info().vocab_size));
  model->forward(*seq, g.tokens, logits.data(), &tap);
  std::vector<std::string> names = {"attnres_out.0", "final_norm.0"};
  for (int64_t l = 0; l <= n_layers; ++l) names.push_back("hidden.0." + std::to_string(l));
  for (const auto& name : names) {
    ASSERT_TRUE(gc.has(name)) << name;
    std::vector<float> ref = gc.view(name).to_f32();
    ASSERT_EQ(ref.size(), got[name].size()) << name;
    double worst = 0.0;
    for (size_t t = 0; t < g.tokens.size(); ++t) {
      worst = std::max(worst, row_rel_error(got[name].data() + t * H, ref.data() + t * H, H));
    }
    EXPECT_LE(worst, kLogitTolerance) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, KimiK3Golden, ::testing::Values("k3-tiny", "k3-tiny-long"),
                         [](const auto& param_info) {
                           std::string s = param_info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

}  // namespace
}  // namespace bg::testing

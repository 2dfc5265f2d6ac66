// DeepSeek-V3 configurations the golden cases do not cover. Each variant is a make-random checkpoint (tiny preset +
// a config patch); the engine (prefill of a 20-token prompt, then 5 greedy decode steps) must match the independent
// double-precision reference of deepseek_v3_reference.h on every logit row (max relative error <= 1e-4, same argmax).
// Each variant also lists mutations of the reference that must move the logits far beyond that tolerance, so the
// feature under test is really exercised by the random weights (a variant the weights cannot tell apart tests
// nothing).
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "model/deepseek_v3_reference.h"
#include "model/model_testing.h"
#include "model/random_checkpoint.h"

namespace bg::testing {
namespace {

using nlohmann::json;

constexpr double kTolerance = 1e-4;          // shared/golden README: fp32 engine vs float64 reference
constexpr double kMutationMinEffect = 1e-2;  // a mutation must change some row by 100x the tolerance
constexpr int64_t kPromptTokens = 20, kDecodeSteps = 5;

struct Mutation {
  std::string name;
  json config_patch;                       // applied to the reference's config, hparams re-derived (may be null)
  std::function<void(RefHparams&)> tweak;  // then applied to the hparams (may be empty)
};

struct Variant {
  std::string name;
  std::string format;
  json patch;
  std::vector<Mutation> mutations;
};

Mutation flip_interleave() {
  return {"rope_interleave flipped", nullptr, [](RefHparams& h) { h.rope_interleave = !h.rope_interleave; }};
}
Mutation no_rope() {
  return {"no rotation", nullptr, [](RefHparams& h) { std::fill(h.inv_freq.begin(), h.inv_freq.end(), 0.0); }};
}
Mutation no_router_bias() {
  return {"router bias ignored", nullptr, [](RefHparams& h) { h.use_router_bias = false; }};
}
Mutation all_groups() {
  return {"all groups kept", nullptr, [](RefHparams& h) { h.topk_group = h.n_group; }};
}
Mutation unit_attention_factor() {
  return {"cos/sin attention factor 1", nullptr, [](RefHparams& h) { h.rope_attention_factor = 1.0; }};
}

std::vector<Variant> variants() {
  const json yarn_ratio = {{"max_position_embeddings", 1024},
                           {"rope_parameters",
                            {{"factor", 4.0}, {"original_max_position_embeddings", 64}, {"beta_fast", 32.0},
                             {"beta_slow", 1.0}}}};
  const json legacy = {{"rope_parameters", nullptr},
                       {"rope_theta", 20000.0},
                       {"rope_scaling",
                        {{"type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 64},
                         {"beta_fast", 1.0}, {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}}};
  return {
      {"baseline_yarn", "bf16", json::object(),
       {flip_interleave(), no_rope(), no_router_bias(),
        {"softmax mscale dropped", nullptr, [](RefHparams& h) { h.softmax_scale = 1.0 / std::sqrt(32.0); }}}},
      {"q_proj_without_lora", "f32", {{"q_lora_rank", nullptr}}, {flip_interleave()}},
      {"grouped_routing", "fp8", {{"n_group", 4}, {"topk_group", 2}}, {all_groups(), no_router_bias()}},
      {"two_shared_experts", "mxfp4", {{"n_shared_experts", 2}},
       {{"shared experts dropped", nullptr, [](RefHparams& h) { h.n_shared = 0; }}}},
      {"default_rope", "bf16", json::parse(R"([{"op": "replace", "path": "/rope_parameters",
                                                "value": {"rope_type": "default", "rope_theta": 10000.0}}])"),
       {flip_interleave(), {"theta 50000", {{"rope_parameters", {{"rope_theta", 50000.0}}}}, {}}}},
      {"default_rope_type_beside_yarn_keys", "bf16", {{"rope_parameters", {{"rope_type", "default"}}}},
       {{"yarn after all", {{"rope_parameters", {{"rope_type", "yarn"}}}}, {}}}},
      {"no_topk_renormalization", "bf16", {{"norm_topk_prob", false}},
       {{"renormalized", nullptr, [](RefHparams& h) { h.norm_topk = true; }}}},
      {"all_layers_moe", "f32", {{"first_k_dense_replace", 0}}, {no_router_bias()}},
      {"two_dense_layers", "bf16", {{"first_k_dense_replace", 2}}, {}},
      {"neox_rope", "bf16", {{"rope_interleave", false}}, {flip_interleave()}},
      {"two_heads", "bf16", {{"num_attention_heads", 2}}, {flip_interleave()}},
      {"eight_heads_small_dims", "fp8",
       {{"num_attention_heads", 8}, {"qk_nope_head_dim", 8}, {"qk_rope_head_dim", 8}, {"v_head_dim", 24}},
       {flip_interleave()}},
      {"wide_rope_dims", "bf16",
       {{"qk_nope_head_dim", 32}, {"qk_rope_head_dim", 32}, {"v_head_dim", 8}, {"kv_lora_rank", 48},
        {"q_lora_rank", 96}},
       {flip_interleave()}},
      {"legacy_rope_scaling", "bf16", legacy,
       {{"rope_scaling ignored", {{"rope_scaling", nullptr}}, {}},
        {"theta 50000", {{"rope_theta", 50000.0}}, {}}}},
      {"yarn_max_over_original_not_factor", "bf16", yarn_ratio,
       {{"ratio equal to factor", {{"max_position_embeddings", 256}}, {}}}},
      // Issue 10: YaRN past the original context. Prompt and decode reach position 24, six times the original 4
      // positions (factor 8 = 32 / 4): the long-context regime of a 128k-token DeepSeek-V3 prompt, scaled down.
      {"yarn_past_4x_original", "bf16",
       {{"max_position_embeddings", 32}, {"rope_parameters", {{"original_max_position_embeddings", 4}, {"factor", 8.0}}}},
       {{"default rope, no YaRN", {{"rope_parameters", {{"rope_type", "default"}}}}, {}}, flip_interleave()}},
      {"yarn_attention_factor", "bf16", {{"rope_parameters", {{"mscale", 1.0}, {"mscale_all_dim", 0.5}}}},
       {unit_attention_factor()}},
      {"yarn_without_mscale_keys", "bf16", {{"rope_parameters", {{"mscale", nullptr}, {"mscale_all_dim", nullptr}}}},
       {unit_attention_factor()}},
      {"yarn_untruncated_ramp", "bf16",
       {{"rope_parameters", {{"truncate", false}, {"beta_fast", 8.0}, {"beta_slow", 0.5}}}},
       {{"truncated", {{"rope_parameters", {{"truncate", true}}}}, {}}}},
      {"yarn_mscale_all_dim_only", "bf16", {{"rope_parameters", {{"mscale", nullptr}}}}, {unit_attention_factor()}},
      {"absent_routing_keys", "bf16",
       json::parse(R"([{"op": "remove", "path": "/n_group"}, {"op": "remove", "path": "/topk_group"},
                       {"op": "remove", "path": "/routed_scaling_factor"}])"),
       {all_groups()}},
      {"tied_embeddings", "f32", {{"tie_word_embeddings", true}}, {}},
      {"top2_of_8_two_groups", "bf16",
       {{"n_routed_experts", 8}, {"num_experts_per_tok", 2}, {"routed_scaling_factor", 1.0}, {"n_group", 2},
        {"topk_group", 1}},
       {all_groups()}},
  };
}

// max |got - ref| / max |ref| over one row.
double rel_error(const float* got, const double* ref, int64_t n) {
  double max_diff = 0.0, max_ref = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

double max_rel_change(const DVec& a, const DVec& b, int64_t V) {
  double worst = 0.0;
  for (size_t r = 0; r < a.size() / static_cast<size_t>(V); ++r) {
    std::vector<float> af(a.begin() + static_cast<int64_t>(r) * V, a.begin() + static_cast<int64_t>(r + 1) * V);
    worst = std::max(worst, rel_error(af.data(), b.data() + static_cast<int64_t>(r) * V, V));
  }
  return worst;
}

// A seed per variant that does not depend on the standard library (FNV-1a of the name, folded to 3 digits).
uint64_t seed_of(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h % 1000;
}

std::vector<int32_t> random_prompt(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = pick(rng);
  return ids;
}

// Logits of the reference with one mutation applied (hparams restored afterwards).
DVec mutated_forward(DeepseekV3Reference& ref, const Mutation& m, const std::vector<int32_t>& ids) {
  const RefHparams saved = ref.hparams();
  if (!m.config_patch.is_null()) {
    json c = ref.config();
    apply_config_patch(c, m.config_patch);
    RefHparams h = ref_hparams(c);
    h.use_router_bias = saved.use_router_bias;
    ref.hparams() = h;
  }
  if (m.tweak) m.tweak(ref.hparams());
  DVec out = ref.forward(ids);
  ref.hparams() = saved;
  return out;
}

// Engine rows against reference rows: relative error and argmax agreement per row.
struct RowComparison {
  std::vector<double> err;
  std::vector<bool> same_argmax;
  double max_prefill = 0.0, max_decode = 0.0, min_margin = 1e30;
  bool ok() const {
    for (size_t t = 0; t < err.size(); ++t) {
      if (err[t] > kTolerance || !same_argmax[t]) return false;
    }
    return true;
  }
};

RowComparison compare_rows(const EngineRun& run, const DVec& want, int64_t V) {
  RowComparison c;
  for (int64_t t = 0; t < static_cast<int64_t>(run.tokens.size()); ++t) {
    const float* got = run.logits.data() + t * V;
    const double* row = want.data() + t * V;
    c.err.push_back(rel_error(got, row, V));
    double& worst = t < run.n_prompt ? c.max_prefill : c.max_decode;
    worst = std::max(worst, c.err.back());
    c.same_argmax.push_back(argmax_row(got, V) == std::max_element(row, row + V) - row);
    DVec sorted(row, row + V);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    c.min_margin = std::min(c.min_margin, sorted[0] - sorted[1]);
  }
  return c;
}

class DeepseekV3Variants : public ::testing::TestWithParam<Variant> {};

TEST_P(DeepseekV3Variants, EngineMatchesIndependentReference) {
  const Variant& v = GetParam();
  TempDir tmp;
  RandomCheckpointSpec spec;
  spec.preset = "tiny";
  spec.format = v.format;
  spec.seed = seed_of(v.name);
  spec.out_dir = tmp / "model";
  spec.config_patch = v.patch;
  write_random_checkpoint(spec);

  auto model = load_model(spec.out_dir);
  const int64_t V = model->info().vocab_size;
  EngineRun run = run_prefill_then_decode(*model, random_prompt(kPromptTokens, V, spec.seed), kDecodeSteps);
  DeepseekV3Reference ref(spec.out_dir);
  DVec want = ref.forward(run.tokens);
  ASSERT_EQ(want.size(), run.logits.size());
  RowComparison cmp = compare_rows(run, want, V);
  std::printf("%-36s %-5s max rel err prefill %.2e decode %.2e (min top-2 margin %.3f)\n", v.name.c_str(),
              v.format.c_str(), cmp.max_prefill, cmp.max_decode, cmp.min_margin);
  RecordProperty("max_rel_err", std::to_string(std::max(cmp.max_prefill, cmp.max_decode)));

  for (const Mutation& m : v.mutations) {
    DVec mutated = mutated_forward(ref, m, run.tokens);
    double effect = max_rel_change(mutated, want, V);
    std::printf("  mutation %-30s changes logits by %.2e\n", m.name.c_str(), effect);
    RowComparison vs_mutated = compare_rows(run, mutated, V);
    if (vs_mutated.ok()) std::printf("  (the engine matches this mutated reference, not the true one)\n");
    EXPECT_GT(effect, kMutationMinEffect) << v.name << ": mutation '" << m.name << "' hardly matters";
  }
  for (size_t t = 0; t < cmp.err.size(); ++t) {
    EXPECT_LE(cmp.err[t], kTolerance) << v.name << " row " << t;
    EXPECT_TRUE(cmp.same_argmax[t]) << v.name << " row " << t << ": engine and reference argmax differ";
  }
}

// The reference itself against transformers: the golden logits HF computed in float64 for the same weights.
TEST(DeepseekV3Reference, MatchesTransformersGoldenLogits) {
  for (const char* name : {"tiny-fp32", "tiny-fp8", "tiny-mxfp4"}) {
    GoldenCase gc(golden_dir() / "deepseek_v3" / name);
    DeepseekV3Reference ref(gc.model_dir());
    const int64_t V = ref.hparams().vocab;
    GoldenPrompt g = gc.prompt(1);
    DVec got = ref.forward(g.tokens);
    double worst = 0.0;
    for (size_t t = 0; t < g.tokens.size(); ++t) {
      std::vector<float> row(got.begin() + static_cast<int64_t>(t) * V, got.begin() + static_cast<int64_t>(t + 1) * V);
      DVec golden(g.logits.begin() + static_cast<int64_t>(t) * V, g.logits.begin() + static_cast<int64_t>(t + 1) * V);
      worst = std::max(worst, rel_error(row.data(), golden.data(), V));
    }
    std::printf("reference vs transformers golden %-10s %zu rows: max rel err %.2e\n", name, g.tokens.size(), worst);
    EXPECT_LE(worst, 1e-5) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, DeepseekV3Variants, ::testing::ValuesIn(variants()),
                         [](const auto& param_info) { return param_info.param.name; });

}  // namespace
}  // namespace bg::testing

// Kimi-K3 configurations the golden cases do not cover. The independent double-precision reference of
// kimi_k3_reference.h is first checked against the golden logits of the official modeling code; then each variant is
// a make-random checkpoint (tiny preset + a text_config patch) on which the engine (prefill of a 70-token prompt that
// crosses the 64-token KDA chunk, then 5 greedy decode steps) must match the reference on every logit row (max
// relative error <= 1e-4, and the same argmax unless the reference's top-2 margin lies inside that error band, a tie
// no fp32 engine can be held to). Each variant lists mutations of the reference (classic mistakes) that must move the
// logits far beyond that tolerance, so the random weights really exercise the feature under test.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "model/kimi_k3_reference.h"
#include "model/model_testing.h"
#include "model/random_checkpoint.h"

namespace bg::testing {
namespace {

using nlohmann::json;

constexpr double kTolerance = 1e-4;          // shared/golden/kimi_k3 README: fp32 engine vs float64 reference
constexpr double kMutationMinEffect = 1e-2;  // a mutation must change some row by 100x the tolerance
constexpr int64_t kPromptTokens = 70, kDecodeSteps = 5;

struct Mutation {
  std::string name;
  std::function<void(K3RefHparams&)> tweak;
};

struct Variant {
  std::string name;
  std::string format;
  json patch;  // merged into text_config
  std::vector<Mutation> mutations;
};

// The classic mistakes (shared/golden/kimi_k3 README, "How far classic mistakes move the logits") and a few more.
Mutation silu_glu() {
  return {"SiLU-GLU instead of SiTU", [](K3RefHparams& h) { h.situ_dense = h.situ_shared = h.situ_experts = false; }};
}
Mutation silu_shared() { return {"SiLU in the shared experts", [](K3RefHparams& h) { h.situ_shared = false; }}; }
Mutation silu_dense() { return {"SiLU in the dense MLPs", [](K3RefHparams& h) { h.situ_dense = false; }}; }
Mutation latent_norm_per_expert() {
  return {"latent norm per expert", [](K3RefHparams& h) { h.latent_norm_per_expert = true; }};
}
Mutation mla_eps() { return {"q_a/kv_a norm eps 1e-5", [](K3RefHparams& h) { h.mla_norm_eps = 1e-5; }}; }
Mutation drop_pe() { return {"q_pe.k_pe dropped", [](K3RefHparams& h) { h.use_pe_scores = false; }}; }
Mutation no_mla_gate() { return {"no MLA output gate", [](K3RefHparams& h) { h.mla_gate = false; }}; }
Mutation softplus_gate() { return {"softplus gate", [](K3RefHparams& h) { h.softplus_gate = true; }}; }
Mutation mix_normed() { return {"mix normalised values", [](K3RefHparams& h) { h.mix_raw_values = false; }}; }
Mutation bank_mixed() { return {"bank the mixed input", [](K3RefHparams& h) { h.bank_raw_input = false; }}; }
Mutation no_output_mix() { return {"no output mix", [](K3RefHparams& h) { h.output_mix = false; }}; }
Mutation no_gate_clamp() { return {"SiTU gate tanh dropped", [](K3RefHparams& h) { h.situ_gate_clamp = false; }}; }
Mutation no_linear_clamp() {
  return {"SiTU linear tanh dropped", [](K3RefHparams& h) { h.situ_linear_clamp = false; }};
}
Mutation no_router_bias() { return {"router bias ignored", [](K3RefHparams& h) { h.use_router_bias = false; }}; }
Mutation head_minor() { return {"KDA channels d-major", [](K3RefHparams& h) { h.kda_head_major = false; }}; }
Mutation no_conv() { return {"no short conv", [](K3RefHparams& h) { h.kda_conv = false; }}; }
Mutation top_k_plus(int64_t d) {
  return {"top-k " + std::string(d > 0 ? "+" : "") + std::to_string(d), [d](K3RefHparams& h) { h.top_k += d; }};
}
Mutation block_size(int64_t b) {
  return {"AttnRes block " + std::to_string(b), [b](K3RefHparams& h) { h.block = b; }};
}
Mutation shared_dropped() { return {"shared experts dropped", [](K3RefHparams& h) { h.n_shared = 0; }}; }

json schedule(int64_t n_layers, std::vector<int64_t> mla_one_based) {
  return {{"num_hidden_layers", n_layers}, {"linear_attn_config", {{"full_attn_layers", mla_one_based}}}};
}

std::vector<Variant> variants() {
  return {
      {"baseline", "mxfp4", json::object(),
       {silu_glu(), silu_shared(), latent_norm_per_expert(), mla_eps(), drop_pe(), no_mla_gate(), softplus_gate(),
        mix_normed(), bank_mixed(), no_output_mix(), no_gate_clamp(), no_linear_clamp(), no_router_bias(), head_minor(),
        no_conv()}},
      {"kda_2x64", "bf16", {{"linear_attn_config", {{"num_heads", 2}, {"head_dim", 64}}}},
       {head_minor(), {"q scale 32^-0.5", [](K3RefHparams& h) { h.q_scale = 1.0 / std::sqrt(32.0); }}}},
      {"kda_8x16", "f32", {{"linear_attn_config", {{"num_heads", 8}, {"head_dim", 16}}}},
       {head_minor(), softplus_gate()}},
      {"mla_2_heads", "bf16", {{"num_attention_heads", 2}}, {drop_pe(), mla_eps()}},
      {"mla_8_heads_16_8_24", "mxfp4",
       {{"num_attention_heads", 8}, {"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 8}, {"v_head_dim", 24}},
       {drop_pe(), {"scale 1/sqrt(nope)", [](K3RefHparams& h) { h.softmax_scale = 0.25; }}}},
      {"mla_wide_pe", "bf16",
       {{"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 32}, {"v_head_dim", 16}, {"kv_lora_rank", 64},
        {"q_lora_rank", 96}},
       {drop_pe()}},
      {"top1", "bf16", {{"num_experts_per_token", 1}}, {top_k_plus(1)}},
      {"top2", "mxfp4", {{"num_experts_per_token", 2}}, {top_k_plus(1)}},
      {"top8", "f32", {{"num_experts_per_token", 8}}, {top_k_plus(-1)}},
      {"experts_8", "bf16", {{"num_experts", 8}}, {no_router_bias()}},
      {"experts_32", "mxfp4", {{"num_experts", 32}}, {no_router_bias()}},
      {"shared_0", "bf16", {{"num_shared_experts", 0}}, {latent_norm_per_expert()}},
      {"shared_1", "f32", {{"num_shared_experts", 1}}, {shared_dropped()}},
      {"shared_3", "mxfp4", {{"num_shared_experts", 3}}, {shared_dropped(), silu_shared()}},
      {"attn_res_block_1", "bf16", {{"attn_res_block_size", 1}}, {block_size(3), bank_mixed()}},
      {"attn_res_block_2", "mxfp4", {{"attn_res_block_size", 2}}, {block_size(3)}},
      {"attn_res_block_4", "f32", {{"attn_res_block_size", 4}}, {block_size(3)}},
      {"attn_res_block_5", "bf16", {{"attn_res_block_size", 5}}, {block_size(3), no_output_mix()}},
      {"all_kda_but_last", "mxfp4", schedule(6, {6}), {softplus_gate(), drop_pe()}},
      {"alternating", "bf16", schedule(8, {2, 4, 6, 8}), {softplus_gate(), drop_pe()}},
      {"mla_first", "f32", schedule(6, {1, 4}), {mla_eps(), no_mla_gate()}},
      {"two_mla_at_end", "bf16", schedule(6, {5, 6}), {drop_pe()}},
      {"first_two_dense", "mxfp4", {{"first_k_dense_replace", 2}}, {silu_dense()}},
      {"no_latent_norm", "bf16", {{"latent_moe_use_norm", false}},
       {{"latent norm applied", [](K3RefHparams& h) { h.force_latent_norm = true; }}}},
      {"grouped_topk_2_keep_1", "mxfp4", {{"use_grouped_topk", true}, {"num_expert_group", 2}, {"topk_group", 1}},
       {{"all groups kept", [](K3RefHparams& h) { h.topk_group = h.n_group; }}}},
      // The latent RMSNorm after the weighted sum cancels any per-token factor of the routing weights, so scaling and
      // renormalisation only show without it.
      {"routed_scaling_2", "bf16", {{"routed_scaling_factor", 2.0}, {"latent_moe_use_norm", false}},
       {{"scaling 1", [](K3RefHparams& h) { h.routed_scaling = 1.0; }}}},
      {"no_renormalize", "f32", {{"moe_renormalize", false}, {"latent_moe_use_norm", false}},
       {{"renormalized", [](K3RefHparams& h) { h.renormalize = true; }}}},
      {"no_mla_output_gate", "f32", {{"mla_use_output_gate", false}}, {drop_pe()}},
  };
}

// max |got - ref| / max |ref| over one row.
template <typename A>
double rel_error(const A* got, const double* ref, int64_t n) {
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
    worst = std::max(worst, rel_error(a.data() + r * V, b.data() + r * V, V));
  }
  return worst;
}

uint64_t seed_of(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h % 1000;
}

// Ids from [0, vocab - 256): no special tokens, as in the golden prompts.
std::vector<int32_t> random_prompt(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab - 256));
  return ids;
}

DVec mutated_forward(KimiK3Reference& ref, const Mutation& m, const std::vector<int32_t>& ids) {
  const K3RefHparams saved = ref.hparams();
  m.tweak(ref.hparams());
  DVec out = ref.forward(ids);
  ref.hparams() = saved;
  return out;
}

struct RowComparison {
  double max_prefill = 0.0, max_decode = 0.0, min_margin = 1e30;
  std::vector<std::string> bad_rows;  // error above tolerance, or a different argmax outside a near-tie
  int64_t n_near_ties = 0;            // rows whose top-2 margin is inside the error band (argmax not checked)
  int64_t n_tie_flips = 0;            // near-tie rows whose argmax does differ
};

RowComparison compare_rows(const EngineRun& run, const DVec& want, int64_t V) {
  RowComparison c;
  for (int64_t t = 0; t < static_cast<int64_t>(run.tokens.size()); ++t) {
    const float* got = run.logits.data() + t * V;
    const double* row = want.data() + t * V;
    const double err = rel_error(got, row, V);
    double& worst = t < run.n_prompt ? c.max_prefill : c.max_decode;
    worst = std::max(worst, err);
    DVec sorted(row, row + V);
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
    const double margin = sorted[0] - sorted[1], max_abs = std::max(sorted[0], -*std::min_element(row, row + V));
    c.min_margin = std::min(c.min_margin, margin);
    // Within tolerance, two logits may each be off by kTolerance * max|row|: a margin below twice that is a tie the
    // comparison cannot decide.
    const bool near_tie = margin <= 2.0 * kTolerance * max_abs;
    c.n_near_ties += near_tie ? 1 : 0;
    const bool same_argmax = argmax_row(got, V) == std::max_element(row, row + V) - row;
    c.n_tie_flips += near_tie && !same_argmax ? 1 : 0;
    if (err > kTolerance || (!same_argmax && !near_tie)) {
      c.bad_rows.push_back("row " + std::to_string(t) + ": rel err " + std::to_string(err) + ", argmax " +
                           (same_argmax ? "same" : "differs") + ", top-2 margin " + std::to_string(margin));
    }
  }
  return c;
}

RandomCheckpointSpec variant_spec(const Variant& v, const std::filesystem::path& out) {
  RandomCheckpointSpec spec;
  spec.arch = "kimi_k3";
  spec.preset = "tiny";
  spec.format = v.format;
  spec.seed = seed_of(v.name);
  spec.out_dir = out;
  spec.config_patch = {{"text_config", v.patch}};
  return spec;
}

class KimiK3Variants : public ::testing::TestWithParam<Variant> {};

TEST_P(KimiK3Variants, EngineMatchesIndependentReference) {
  const Variant& v = GetParam();
  TempDir tmp;
  RandomCheckpointSpec spec = variant_spec(v, tmp / "model");
  write_random_checkpoint(spec);
  auto model = load_model(spec.out_dir);
  const int64_t V = model->info().vocab_size;
  EngineRun run = run_prefill_then_decode(*model, random_prompt(kPromptTokens, V, spec.seed), kDecodeSteps);
  KimiK3Reference ref(spec.out_dir);
  DVec want = ref.forward(run.tokens);
  ASSERT_EQ(want.size(), run.logits.size());
  RowComparison cmp = compare_rows(run, want, V);
  std::printf("%-24s %-5s max rel err prefill %.2e decode %.2e (min top-2 margin %.4f; %ld near-tie rows, %ld with "
              "another argmax)\n", v.name.c_str(), v.format.c_str(), cmp.max_prefill, cmp.max_decode, cmp.min_margin,
              static_cast<long>(cmp.n_near_ties), static_cast<long>(cmp.n_tie_flips));
  RecordProperty("max_rel_err", std::to_string(std::max(cmp.max_prefill, cmp.max_decode)));
  for (const Mutation& m : v.mutations) {
    const double effect = max_rel_change(mutated_forward(ref, m, run.tokens), want, V);
    std::printf("  mutation %-28s changes logits by %.2e\n", m.name.c_str(), effect);
    EXPECT_GT(effect, kMutationMinEffect) << v.name << ": mutation '" << m.name << "' hardly matters";
  }
  for (const auto& bad : cmp.bad_rows) ADD_FAILURE() << v.name << " " << bad;
}

INSTANTIATE_TEST_SUITE_P(Configs, KimiK3Variants, ::testing::ValuesIn(variants()),
                         [](const auto& param_info) { return param_info.param.name; });

// The reference against the official modeling code: every golden logit row of k3-tiny and k3-tiny-long.
TEST(KimiK3Reference, MatchesOfficialGoldenLogits) {
  for (const char* name : {"k3-tiny", "k3-tiny-long"}) {
    GoldenCase gc(golden_dir() / "kimi_k3" / name);
    KimiK3Reference ref(gc.model_dir());
    const int64_t V = ref.hparams().vocab;
    double worst = 0.0;
    size_t rows = 0;
    for (int64_t i = 0; i < gc.n_prompts(); ++i) {
      GoldenPrompt g = gc.prompt(i);
      DVec got = ref.forward(g.tokens);
      for (size_t t = 0; t < g.tokens.size(); ++t, ++rows) {
        DVec golden(g.logits.begin() + static_cast<int64_t>(t) * V, g.logits.begin() + static_cast<int64_t>(t + 1) * V);
        worst = std::max(worst, rel_error(got.data() + t * V, golden.data(), V));
      }
    }
    std::printf("reference vs official golden %-13s %zu rows: max rel err %.2e\n", name, rows, worst);
    EXPECT_LE(worst, 1e-6) << name;
  }
}

// The tiny preset's init scales exercise what the golden README asks for: both tanh clamps of SiTU, KDA gates near
// the lower bound, q_a/kv_a latents small enough that the eps 1e-6 of their norms matters.
TEST(KimiK3Reference, TinyPresetInitExercisesEveryPath) {
  TempDir tmp;
  RandomCheckpointSpec spec = variant_spec({"init", "mxfp4", json::object(), {}}, tmp / "model");
  write_random_checkpoint(spec);
  KimiK3Reference ref(spec.out_dir);
  ref.forward(random_prompt(kPromptTokens, ref.hparams().vocab, 5));
  const K3RefStats& s = ref.stats();
  const double near_bound = static_cast<double>(s.n_gate_near_bound) / static_cast<double>(s.n_gate);
  std::printf("max |gate|/beta %.2f, max |up|/linear beta %.2f, KDA gates below 0.9 x bound %.1f%%, smallest latent "
              "mean square %.2e\n", s.max_situ_gate, s.max_situ_up, 100.0 * near_bound, s.min_latent_ms);
  EXPECT_GT(s.max_situ_gate, 2.0);
  EXPECT_GT(s.max_situ_up, 0.5);
  EXPECT_GT(near_bound, 0.01);
  EXPECT_LT(s.min_latent_ms, 1e-5);
}

// The mutations are exactly the golden README's classic mistakes: on k3-tiny's tokens.1 they move the logits by what
// its case.json records for the official code (mutation_max_rel_logit_diff = max |delta| / max |logit| over all rows).
TEST(KimiK3Reference, MutationsMoveGoldenLogitsAsRecorded) {
  const auto dir = golden_dir() / "kimi_k3" / "k3-tiny";
  GoldenCase gc(dir);
  KimiK3Reference ref(gc.model_dir());
  const json recorded = read_json_file(dir / "case.json").at("checks").at("mutation_max_rel_logit_diff");
  const std::vector<std::pair<std::string, Mutation>> named = {
      {"silu_glu", silu_glu()}, {"silu_shared_expert", silu_shared()},
      {"latent_norm_per_expert", latent_norm_per_expert()}, {"mla_norm_eps_1e-5", mla_eps()},
      {"drop_pe_scores", drop_pe()}, {"no_mla_gate", no_mla_gate()}, {"softplus_gate", softplus_gate()},
      {"mix_normed_values", mix_normed()}, {"bank_mixed_input", bank_mixed()}, {"no_output_mix", no_output_mix()}};
  const std::vector<int32_t> tokens = gc.prompt(1).tokens;
  const DVec base = ref.forward(tokens);
  double max_ref = 0.0;
  for (double x : base) max_ref = std::max(max_ref, std::fabs(x));
  for (const auto& [key, m] : named) {
    const DVec mutated = mutated_forward(ref, m, tokens);
    double max_diff = 0.0;
    for (size_t i = 0; i < base.size(); ++i) max_diff = std::max(max_diff, std::fabs(mutated[i] - base[i]));
    const double want = recorded.at(key).get<double>();
    std::printf("  mutation %-24s %.6f (official code: %.6f)\n", key.c_str(), max_diff / max_ref, want);
    EXPECT_NEAR(max_diff / max_ref, want, 1e-5) << key;
  }
}
}  // namespace
}  // namespace bg::testing

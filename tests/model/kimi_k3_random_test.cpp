// make-random --arch kimi_k3: the tiny preset has the tensor names, dtypes, shapes and config of the k3-tiny golden
// checkpoint; every format loads and runs; bytes depend only on the seed; bad specs are clear errors; the
// real-dimension ep16-rank preset is checked by arithmetic only (never written here).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "model/model_testing.h"
#include "model/random_checkpoint.h"

namespace bg::testing {
namespace {

using nlohmann::json;

RandomCheckpointSpec k3_spec(const std::filesystem::path& out, const std::string& format, uint64_t seed = 7) {
  RandomCheckpointSpec s;
  s.arch = "kimi_k3";
  s.preset = "tiny";
  s.format = format;
  s.seed = seed;
  s.out_dir = out;
  return s;
}

std::filesystem::path golden_tiny() { return golden_dir() / "kimi_k3" / "k3-tiny" / "model"; }

std::map<std::string, std::string> dir_files(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out[e.path().filename().string()] = file_bytes(e.path());
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

class K3MakeRandomFormat : public ::testing::TestWithParam<std::string> {};

TEST_P(K3MakeRandomFormat, LoadsAndGivesFiniteDistinctLogits) {
  TempDir tmp;
  write_random_checkpoint(k3_spec(tmp / "m", GetParam()));
  auto model = load_model(tmp / "m");
  const int64_t V = model->info().vocab_size;
  ASSERT_EQ(V, 1024);
  EngineRun run = run_prefill_then_decode(*model, {3, 141, 59, 26, 5, 358, 97, 93, 238, 462, 64, 33}, 4);
  ASSERT_TRUE(all_finite(run.logits));
  std::set<int32_t> argmaxes;
  for (size_t t = 0; t < run.tokens.size(); ++t) {
    const float* row = run.logits.data() + t * static_cast<size_t>(V);
    auto [lo, hi] = std::minmax_element(row, row + V);
    EXPECT_GT(*hi - *lo, 4.0f) << "row " << t;
    argmaxes.insert(argmax_row(row, V));
  }
  EXPECT_GE(argmaxes.size(), 4u);
}

// Names, dtypes and shapes as in the golden k3-tiny checkpoint. bf16/f32 store the routed experts dense
// (`.weight` [out, in] instead of `.weight_packed` [out, in/2] + `.weight_scale`); f32 stores everything F32.
TEST_P(K3MakeRandomFormat, SameLayoutAsGoldenCheckpoint) {
  const std::string format = GetParam();
  TempDir tmp;
  write_random_checkpoint(k3_spec(tmp / "m", format));
  auto ours = Checkpoint::open(tmp / "m");
  auto ref = Checkpoint::open(golden_tiny());
  std::map<std::string, std::pair<std::string, Shape>> want;  // name -> (dtype, shape)
  for (const auto& name : ref->names()) {
    TensorView t = ref->get(name);
    std::string dtype = format == "f32" ? "F32" : std::string(dtype_name(t.dtype));
    if (format != "mxfp4" && ends_with(name, ".weight_scale")) continue;
    if (format != "mxfp4" && ends_with(name, ".weight_packed")) {
      want[name.substr(0, name.size() - 7)] = {format == "f32" ? "F32" : "BF16", {t.shape[0], t.shape[1] * 2}};
      continue;
    }
    want[name] = {dtype, t.shape};
  }
  std::vector<std::string> our_names = ours->names();
  ASSERT_EQ(our_names.size(), want.size());
  for (const auto& name : our_names) {
    ASSERT_EQ(want.count(name), 1u) << name;
    TensorView t = ours->get(name);
    EXPECT_EQ(dtype_name(t.dtype), want[name].first) << name;
    EXPECT_EQ(t.shape, want[name].second) << name;
  }
  // A_log: [head_dim] with zeros beyond num_heads, as in the real checkpoint.
  std::vector<float> a_log = ours->get("language_model.model.layers.0.self_attn.A_log").to_f32();
  ASSERT_EQ(a_log.size(), 32u);
  for (size_t i = 0; i < a_log.size(); ++i) EXPECT_EQ(a_log[i] == 0.0f, i >= 4) << i;
}

// config.json equals the golden's field for field, except text_config.dtype ("float32") for f32 and the absent
// quantization_config of the unquantized formats; generation_config.json equals the golden's.
TEST_P(K3MakeRandomFormat, SameConfigAsGoldenCheckpoint) {
  const std::string format = GetParam();
  TempDir tmp;
  write_random_checkpoint(k3_spec(tmp / "m", format));
  json cfg = read_json_file(tmp / "m" / "config.json"), want = read_json_file(golden_tiny() / "config.json");
  if (format != "mxfp4") want.erase("quantization_config");
  if (format == "f32") want["text_config"]["dtype"] = "float32";
  EXPECT_EQ(cfg, want) << "ours:\n" << cfg.dump(2);
  EXPECT_EQ(read_json_file(tmp / "m" / "generation_config.json"),
            read_json_file(golden_tiny() / "generation_config.json"));
}

INSTANTIATE_TEST_SUITE_P(Formats, K3MakeRandomFormat, ::testing::Values("mxfp4", "bf16", "f32"),
                         [](const auto& param_info) { return param_info.param; });

TEST(K3MakeRandom, SameSeedIsByteIdenticalAndSeedsDiffer) {
  TempDir tmp;
  for (const char* format : {"mxfp4", "bf16", "f32"}) {
    const std::string f = format;
    write_random_checkpoint(k3_spec(tmp / ("a_" + f), f, 11));
    write_random_checkpoint(k3_spec(tmp / ("b_" + f), f, 11));
    auto a = dir_files(tmp / ("a_" + f)), b = dir_files(tmp / ("b_" + f));
    ASSERT_EQ(a.size(), 5u);  // config, generation_config, index, 2 shards
    EXPECT_TRUE(a == b) << format;
  }
  write_random_checkpoint(k3_spec(tmp / "c_mxfp4", "mxfp4", 12));
  auto a = Checkpoint::open(tmp / "a_mxfp4"), c = Checkpoint::open(tmp / "c_mxfp4");
  for (const auto& name : a->names()) {
    if (ends_with(name, "weight_scale")) continue;  // E8M0 exponents of same-scale weights may coincide
    EXPECT_NE(a->get(name).to_f32(), c->get(name).to_f32()) << name;
  }
}

// Row pieces and threads leave the bytes alone, including the element-indexed adjustments (kv_a_proj's scaled c rows,
// A_log's zero tail) that a piece sees only part of.
TEST(K3MakeRandom, ThreadsAndPiecesDoNotChangeTheBytes) {
  TempDir tmp;
  RandomCheckpointSpec one = k3_spec(tmp / "one", "mxfp4", 3);
  one.n_threads = 1;
  RandomCheckpointSpec many = k3_spec(tmp / "many", "mxfp4", 3);
  many.n_threads = 4;
  many.piece_elements = 64;
  write_random_checkpoint(one);
  write_random_checkpoint(many);
  EXPECT_TRUE(dir_files(tmp / "one") == dir_files(tmp / "many"));
  // The adjustments took effect: A_log is zero past the heads, kv_a_proj's first kv_lora rows are 0.003x the rest.
  auto ckpt = Checkpoint::open(tmp / "many");
  int checked = 0;
  for (const auto& name : ckpt->names()) {
    if (ends_with(name, "A_log")) {  // tiny: 4 heads, stored [32]
      std::vector<float> a = ckpt->get(name).to_f32();
      ASSERT_EQ(a.size(), 32u);
      for (size_t i = 4; i < a.size(); ++i) EXPECT_EQ(a[i], 0.0f) << name << " [" << i << "]";
      ++checked;
    }
    if (ends_with(name, "kv_a_proj_with_mqa.weight")) {  // tiny: [32 c rows + 16 k_pe rows, 128]
      std::vector<float> w = ckpt->get(name).to_f32();
      ASSERT_EQ(w.size(), 48u * 128u);
      double c_rows = 0, pe_rows = 0;
      for (size_t i = 0; i < w.size(); ++i) (i < 32u * 128u ? c_rows : pe_rows) += std::fabs(w[i]);
      EXPECT_LT(c_rows / (32 * 128), 0.01 * pe_rows / (16 * 128)) << name;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 10);  // 6 KDA layers, 4 MLA layers
}

TEST(K3MakeRandom, DefaultFormatIsMxfp4AndTotalBytesMatchTheIndex) {
  TempDir tmp;
  RandomCheckpointSpec s = k3_spec(tmp / "m", "");
  write_random_checkpoint(s);
  json cfg = read_json_file(tmp / "m" / "config.json");
  EXPECT_EQ(cfg.at("quantization_config").at("quant_method"), "compressed-tensors");
  auto ckpt = Checkpoint::open(tmp / "m");
  EXPECT_TRUE(ckpt->contains("language_model.model.layers.1.block_sparse_moe.experts.15.w2.weight_packed"));
  json index = read_json_file(tmp / "m" / "model.safetensors.index.json");
  const uint64_t total = index.at("metadata").at("total_size").get<uint64_t>();
  EXPECT_EQ(total, random_checkpoint_total_bytes(s));
  EXPECT_EQ(total, read_json_file(golden_tiny() / "model.safetensors.index.json")["metadata"]["total_size"]);
}

TEST(K3MakeRandom, BadSpecsAreClearErrors) {
  TempDir tmp;
  auto err = [&](auto mutate) {
    auto s = k3_spec(tmp / "m", "mxfp4");
    mutate(s);
    return bg_error_of([&] { write_random_checkpoint(s); });
  };
  auto text = [](json patch) { return json{{"text_config", std::move(patch)}}; };
  EXPECT_NE(err([](auto& s) { s.format = "fp8"; }).find("kimi_k3 has no 'fp8' format (choose mxfp4, bf16, f32)"),
            std::string::npos);
  EXPECT_NE(err([](auto& s) { s.preset = "huge"; }).find("unknown preset 'huge' for kimi_k3 (choose tiny, ep16-rank)"),
            std::string::npos);
  EXPECT_NE(err([&](auto& s) { s.config_patch = text({{"moe_intermediate_size", 48}}); })
                .find("input dim 48, not a multiple of 32"),
            std::string::npos);
  EXPECT_NE(err([&](auto& s) { s.config_patch = text({{"linear_attn_config", {{"full_attn_layers", {0, 3}}}}}); })
                .find("full_attn_layers entry 0 is outside 1..10 (the lists are 1-based)"),
            std::string::npos);
  EXPECT_NE(err([&](auto& s) { s.config_patch = text({{"num_experts_per_token", 17}}); })
                .find("num_experts_per_token 17 must be in [1, num_experts=16]"),
            std::string::npos);
  EXPECT_NE(err([&](auto& s) { s.config_patch = text({{"hidden_act", "silu"}}); }).find("hidden_act 'silu'"),
            std::string::npos);
  EXPECT_NE(err([](auto& s) { s.n_shards = 0; }).find("shard count 0"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(tmp / "m"));  // nothing was written
}

TEST(K3MakeRandom, ConfigPatchKeepsDerivedFieldsConsistent) {
  RandomCheckpointSpec s = k3_spec("unused", "bf16");
  s.config_patch = {{"text_config",
                     {{"vocab_size", 512},
                      {"num_hidden_layers", 5},
                      {"num_attention_heads", 2},
                      {"linear_attn_config", {{"full_attn_layers", {1, 4}}}}}}};
  json c = random_checkpoint_config(s);
  const json& t = c.at("text_config");
  EXPECT_EQ(t.at("linear_attn_config").at("kda_layers"), json({2, 3, 5}));
  EXPECT_EQ(t.at("linear_attn_config").at("head_dim"), 32);  // untouched keys of a merged object stay
  EXPECT_EQ(t.at("num_key_value_heads"), 2);
  EXPECT_EQ(c.at("bos_token_id"), 256);
  EXPECT_EQ(c.at("eos_token_id"), 258);
  EXPECT_EQ(t.at("pad_token_id"), 511);
  EXPECT_EQ(c.at("media_placeholder_token_id"), 277);
  EXPECT_FALSE(c.contains("quantization_config"));
}

// Bytes of the ep16-rank preset recomputed from docs/kimi_k3.md section 3 (BF16 2 B, F32 4 B; one MXFP4 expert
// 17,547,264 B), against the writer's plan. Nothing is written.
TEST(K3MakeRandom, Ep16RankPresetDimsAndBytes) {
  RandomCheckpointSpec s;
  s.arch = "kimi_k3";
  s.preset = "ep16-rank";
  json c = random_checkpoint_config(s);
  const json& t = c.at("text_config");
  EXPECT_EQ(t.at("hidden_size"), 7168);
  EXPECT_EQ(t.at("vocab_size"), 163840);
  EXPECT_EQ(t.at("linear_attn_config").at("full_attn_layers"), json({4}));
  EXPECT_EQ(t.at("linear_attn_config").at("kda_layers"), json({1, 2, 3}));
  EXPECT_EQ(t.at("num_experts"), 56);
  EXPECT_EQ(t.at("num_experts_per_token"), 16);
  EXPECT_EQ(c.at("eos_token_id"), 163586);  // the real id
  EXPECT_EQ(c.at("bos_token_id"), 163584);

  const uint64_t H = 7168, V = 163840, P = 96 * 128, K = 128, bf = 2, f32 = 4;
  const uint64_t global = 2 * V * H * bf + 3 * H * bf;
  const uint64_t per_layer = 6 * H * bf;
  const uint64_t kda = 5 * P * H * bf + K * H * bf + P * K * bf + 96 * H * bf + 3 * P * 4 * f32 + (K + P + K) * f32;
  const uint64_t mla = (1536 * H + 1536 + 18432 * 1536 + 576 * H + 512 + 24576 * 512 + 2 * 12288 * H) * bf;
  const uint64_t dense = 3 * 33792 * H * bf;
  const uint64_t moe_resident = (56 * H + 2 * 3584 * H + 3584 + 3 * 6144 * H) * bf + 56 * f32;
  const uint64_t expert_mxfp4 = 17547264, expert_bf16 = 3 * 3584 * 3072 * bf;
  const uint64_t common = global + 4 * per_layer + 3 * kda + mla + dense + 3 * moe_resident;
  const uint64_t mxfp4 = common + 3 * 56 * expert_mxfp4, bf16 = common + 3 * 56 * expert_bf16;
  EXPECT_EQ(random_checkpoint_total_bytes(s), mxfp4);
  s.format = "bf16";
  EXPECT_EQ(random_checkpoint_total_bytes(s), bf16);
  std::printf("ep16-rank writes %.2f GB (mxfp4), %.2f GB (bf16); the vocabulary rows are %.2f GB\n", mxfp4 / 1e9,
              bf16 / 1e9, 2.0 * static_cast<double>(V * H * bf) / 1e9);
}

}  // namespace
}  // namespace bg::testing

// config.json parsing: legacy rope_scaling vs v5 rope_parameters, nullable fields, type errors naming the key, and
// invalid MoE grouping.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "formats/formats_testing.h"
#include "formats/model_config.h"

namespace bg {
namespace {

using json = nlohmann::json;
using testing::expect_error;
using testing::TempDir;
using testing::write_bytes;

// A small DeepSeek-V3-shaped config (legacy layout: top-level rope_theta, rope_scaling with "type").
json small_config() {
  return json::parse(R"({
    "model_type": "deepseek_v3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": true, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
  })");
}

void expect_same_rope(const RopeConfig& a, const RopeConfig& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.theta, b.theta);
  EXPECT_EQ(a.factor, b.factor);
  EXPECT_EQ(a.original_max_position_embeddings, b.original_max_position_embeddings);
  EXPECT_EQ(a.beta_fast, b.beta_fast);
  EXPECT_EQ(a.beta_slow, b.beta_slow);
  EXPECT_EQ(a.mscale, b.mscale);
  EXPECT_EQ(a.mscale_all_dim, b.mscale_all_dim);
  EXPECT_EQ(a.attention_factor, b.attention_factor);
  EXPECT_EQ(a.truncate, b.truncate);
}

TEST(ModelConfig, ParsesSmallDeepseekConfig) {
  DeepseekV3Config c = parse_deepseek_v3_config(small_config(), "config.json");
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.q_lora_rank, 96);
  EXPECT_EQ(c.qk_head_dim(), 48);
  EXPECT_EQ(c.kv_cache_dim(), 80);
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_TRUE(c.is_moe_layer(1));
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.rope.mscale_all_dim, 1.0);
  EXPECT_EQ(c.eos_token_id, 1);
  EXPECT_EQ(detect_arch(small_config(), "config.json"), Arch::kDeepseekV3);
}

TEST(ModelConfig, LegacyRopeScalingEqualsV5RopeParameters) {
  json legacy = small_config();
  json v5 = small_config();
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5["rope_parameters"] = json::parse(R"({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
      "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
      "mscale_all_dim": 1.0})");
  expect_same_rope(parse_rope_config(legacy, "legacy"), parse_rope_config(v5, "v5"));
  expect_same_rope(parse_deepseek_v3_config(legacy, "legacy").rope, parse_deepseek_v3_config(v5, "v5").rope);
  // Kimi-style: beta_fast = beta_slow = 1, theta 5e4, optional keys given.
  json kimi_legacy = small_config();
  kimi_legacy["rope_theta"] = 50000.0;
  kimi_legacy["rope_scaling"] = json::parse(R"({"type": "yarn", "factor": 32, "beta_fast": 1, "beta_slow": 1,
      "mscale": 1, "mscale_all_dim": 1, "original_max_position_embeddings": 4096, "truncate": false,
      "attention_factor": 0.5})");
  json kimi_v5 = small_config();
  kimi_v5.erase("rope_scaling");
  kimi_v5["rope_parameters"] = json::parse(R"({"rope_type": "yarn", "rope_theta": 50000, "factor": 32.0,
      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096, "truncate": false, "attention_factor": 0.5})");
  RopeConfig a = parse_rope_config(kimi_legacy, "legacy");
  expect_same_rope(a, parse_rope_config(kimi_v5, "v5"));
  EXPECT_EQ(a.theta, 50000.0);
  EXPECT_EQ(a.beta_fast, 1.0);
  EXPECT_FALSE(a.truncate);
  EXPECT_EQ(a.attention_factor, 0.5);
}

TEST(ModelConfig, YarnDefaults) {
  json j = small_config();
  j["rope_scaling"] = json::parse(R"({"type": "yarn", "factor": 4, "original_max_position_embeddings": 2048})");
  RopeConfig r = parse_rope_config(j, "config.json");
  EXPECT_EQ(r.beta_fast, 32.0);
  EXPECT_EQ(r.beta_slow, 1.0);
  // Absent mscale keys stay 0 ("unset"), as transformers' .get() gives None.
  EXPECT_EQ(r.mscale, 0.0);
  EXPECT_EQ(r.mscale_all_dim, 0.0);
  EXPECT_FALSE(r.attention_factor.has_value());
  EXPECT_TRUE(r.truncate);
}

TEST(ModelConfig, NoRopeScaling) {
  json j = small_config();
  j.erase("rope_scaling");
  RopeConfig r = parse_rope_config(j, "config.json");
  EXPECT_EQ(r.type, "default");
  EXPECT_EQ(r.theta, 10000.0);
  EXPECT_EQ(r.factor, 1.0);
  j["rope_scaling"] = nullptr;  // explicit null is "no scaling" too
  j["rope_theta"] = 50000;
  r = parse_rope_config(j, "config.json");
  EXPECT_EQ(r.type, "default");
  EXPECT_EQ(r.theta, 50000.0);
  j.erase("rope_theta");
  EXPECT_EQ(parse_rope_config(j, "config.json").theta, 10000.0);  // HF default
  j["rope_parameters"] = json::parse(R"({"rope_type": "default", "rope_theta": 1000000.0})");
  r = parse_rope_config(j, "config.json");
  EXPECT_EQ(r.type, "default");
  EXPECT_EQ(r.theta, 1e6);
  EXPECT_EQ(parse_deepseek_v3_config(j, "config.json").rope.type, "default");
}

TEST(ModelConfig, NullableFields) {
  json j = small_config();
  j["q_lora_rank"] = nullptr;
  EXPECT_EQ(parse_deepseek_v3_config(j, "config.json").q_lora_rank, 0);
  // Absent (not null): transformers' default of 1536.
  j.erase("q_lora_rank");
  EXPECT_EQ(parse_deepseek_v3_config(j, "config.json").q_lora_rank, 1536);
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = json::array({7, 8});
  DeepseekV3Config c = parse_deepseek_v3_config(j, "config.json");
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_EQ(c.eos_token_id, 7);
}

TEST(ModelConfig, WrongTypesNameTheKey) {
  auto with = [](const std::string& key, json value) {
    json j = small_config();
    j[key] = std::move(value);
    return j;
  };
  expect_error([&] { parse_deepseek_v3_config(with("hidden_size", "256"), "config.json"); },
               {"config.json", "'hidden_size' must be an integer", "\"256\""});
  expect_error([&] { parse_deepseek_v3_config(with("num_hidden_layers", 4.5), "config.json"); },
               {"'num_hidden_layers' must be an integer"});
  expect_error([&] { parse_deepseek_v3_config(with("q_lora_rank", "1536"), "config.json"); },
               {"'q_lora_rank' must be an integer"});
  expect_error([&] { parse_deepseek_v3_config(with("norm_topk_prob", "true"), "config.json"); },
               {"'norm_topk_prob' must be true or false"});
  expect_error([&] { parse_deepseek_v3_config(with("routed_scaling_factor", "2.5"), "config.json"); },
               {"'routed_scaling_factor' must be a number"});
  expect_error([&] { parse_deepseek_v3_config(with("model_type", 3), "config.json"); },
               {"'model_type' must be a string"});
  expect_error([&] { parse_deepseek_v3_config(with("eos_token_id", json::array({1, "x"})), "config.json"); },
               {"'eos_token_id' must be a list of integers"});
  expect_error([&] { parse_deepseek_v3_config(with("rope_scaling", "yarn"), "config.json"); },
               {"'rope_scaling' must be an object"});
  json bad_factor = small_config();
  bad_factor["rope_scaling"]["factor"] = "40";
  expect_error([&] { parse_deepseek_v3_config(bad_factor, "config.json"); },
               {"config.json rope_scaling", "'factor' must be a number"});
  json bad_type = small_config();
  bad_type["rope_scaling"]["type"] = 1;
  expect_error([&] { parse_rope_config(bad_type, "config.json"); }, {"'type' must be a string"});
  expect_error([&] { parse_deepseek_v3_config(json::array({1}), "config.json"); },
               {"config.json", "expected a JSON object"});
}

TEST(ModelConfig, MissingAndInvalidValues) {
  json j = small_config();
  j.erase("model_type");
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"missing required field 'model_type'"});
  // Absent architecture keys take transformers' DeepseekV3Config defaults.
  j = small_config();
  j.erase("kv_lora_rank");
  j.erase("routed_scaling_factor");
  EXPECT_EQ(parse_deepseek_v3_config(j, "config.json").kv_lora_rank, 512);
  EXPECT_EQ(parse_deepseek_v3_config(j, "config.json").routed_scaling_factor, 2.5);
  j = small_config();
  j["rope_scaling"].erase("factor");
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"missing required field 'factor'"});
  j = small_config();
  j["rope_scaling"]["type"] = "linear";
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"rope type 'linear' is not supported"});
  j = small_config();
  j["rope_scaling"]["factor"] = 0.5;
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"yarn factor 0.5 must be >= 1"});
  j = small_config();
  j["qk_rope_head_dim"] = 15;
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"qk_rope_head_dim 15 must be even"});
  j = small_config();
  j["scoring_func"] = "softmax";
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"scoring_func 'softmax' is not supported"});
  expect_error([&] { detect_arch(json{{"model_type", "llama"}}, "config.json"); },
               {"unsupported model_type 'llama'"});
}

TEST(ModelConfig, InvalidGrouping) {
  json j = small_config();
  j["topk_group"] = 5;  // > n_group = 4
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"topk_group 5 must be in [1, n_group=4]"});
  j["topk_group"] = 0;
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"topk_group 0"});
  j = small_config();
  j["n_group"] = 3;  // 16 experts do not split into 3 groups
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"not divisible by n_group 3"});
  j = small_config();
  j["num_experts_per_tok"] = 17;
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"num_experts_per_tok 17"});
  j = small_config();
  j["topk_group"] = 1;
  j["num_experts_per_tok"] = 5;  // one group of 4 experts cannot supply 5
  expect_error([&] { parse_deepseek_v3_config(j, "config.json"); }, {"exceeds the experts in topk_group groups"});
  j = small_config();
  j["n_group"] = 1;  // Kimi: plain top-k
  j["topk_group"] = 1;
  EXPECT_EQ(parse_deepseek_v3_config(j, "config.json").n_group, 1);
}

TEST(ModelConfig, LoadFromDirectory) {
  TempDir dir;
  write_bytes(dir / "config.json", small_config().dump());
  EXPECT_EQ(load_deepseek_v3_config(dir.path()).vocab_size, 1024);
  write_bytes(dir / "config.json", "{\"model_type\": ");
  expect_error([&] { load_deepseek_v3_config(dir.path()); }, {"config.json", "not valid JSON"});
  std::filesystem::remove(dir / "config.json");
  expect_error([&] { load_deepseek_v3_config(dir.path()); }, {"cannot open", "config.json"});
}

}  // namespace
}  // namespace bg

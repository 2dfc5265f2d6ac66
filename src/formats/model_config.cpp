// config.json parsing for DeepSeek-V3 / Kimi-K2 and architecture detection.
#include "formats/model_config.h"

#include "core/error.h"
#include "formats/json_fields.h"

namespace bg {

Arch detect_arch(const nlohmann::json& config, const std::string& where) {
  JsonFields f(config, where);
  std::string type = f.get_string("model_type", "");
  if (type == "deepseek_v3" || type == "kimi_k2" || type == "deepseek_v2") return Arch::kDeepseekV3;
  if (type == "kimi_k3" || type == "kimi_linear") return Arch::kKimiK3;
  fail("{}: unsupported model_type '{}' (supported: deepseek_v3, kimi_k2, kimi_k3)", where, type);
}

RopeConfig parse_rope_config(const nlohmann::json& config, const std::string& where) {
  JsonFields f(config, where);
  RopeConfig r;
  r.theta = f.get_double("rope_theta", 10000.0);
  const char* key = f.has("rope_parameters") ? "rope_parameters" : (f.has("rope_scaling") ? "rope_scaling" : nullptr);
  if (key == nullptr) return r;
  JsonFields p = f.object(key);
  if (p.has("rope_type")) {
    r.type = p.get_string("rope_type");
  } else if (p.has("type")) {
    r.type = p.get_string("type");
  }
  r.theta = p.get_double("rope_theta", r.theta);
  if (r.type == "default") return r;
  BG_CHECK(r.type == "yarn", "{}: rope type '{}' is not supported (default, yarn)", p.where(), r.type);
  r.factor = p.get_double("factor");
  BG_CHECK(r.factor >= 1.0, "{}: yarn factor {} must be >= 1", p.where(), r.factor);
  r.original_max_position_embeddings = p.get_int("original_max_position_embeddings");
  BG_CHECK(r.original_max_position_embeddings > 0, "{}: original_max_position_embeddings must be positive",
           p.where());
  r.beta_fast = p.get_double("beta_fast", 32.0);
  r.beta_slow = p.get_double("beta_slow", 1.0);
  r.mscale = p.get_double("mscale", 0.0);
  r.mscale_all_dim = p.get_double("mscale_all_dim", 0.0);
  if (p.has("attention_factor")) r.attention_factor = p.get_double("attention_factor");
  r.truncate = p.get_bool("truncate", true);
  return r;
}

DeepseekV3Config parse_deepseek_v3_config(const nlohmann::json& config, const std::string& where) {
  JsonFields f(config, where);
  DeepseekV3Config c;
  // Absent keys take transformers' DeepseekV3Config defaults, so a config means what it means there.
  c.model_type = f.get_string("model_type");
  c.vocab_size = f.get_int("vocab_size", 129280);
  c.hidden_size = f.get_int("hidden_size", 7168);
  c.intermediate_size = f.get_int("intermediate_size", 18432);
  c.moe_intermediate_size = f.get_int("moe_intermediate_size", 2048);
  c.n_layers = f.get_int("num_hidden_layers", 61);
  c.n_heads = f.get_int("num_attention_heads", 128);
  // q_lora_rank: explicit null means a plain q_proj; absent means the default 1536.
  c.q_lora_rank = f.json().contains("q_lora_rank") ? f.get_optional_int("q_lora_rank").value_or(0) : 1536;
  c.kv_lora_rank = f.get_int("kv_lora_rank", 512);
  c.qk_nope_head_dim = f.get_int("qk_nope_head_dim", 128);
  c.qk_rope_head_dim = f.get_int("qk_rope_head_dim", 64);
  c.v_head_dim = f.get_int("v_head_dim", 128);
  c.n_routed_experts = f.get_int("n_routed_experts", 256);
  c.n_shared_experts = f.get_int("n_shared_experts", 1);
  c.n_experts_per_tok = f.get_int("num_experts_per_tok", 8);
  c.n_group = f.get_int("n_group", 8);
  c.topk_group = f.get_int("topk_group", 4);
  c.first_k_dense_replace = f.get_int("first_k_dense_replace", 3);
  c.moe_layer_freq = f.get_int("moe_layer_freq", 1);
  c.routed_scaling_factor = f.get_double("routed_scaling_factor", 2.5);
  c.norm_topk_prob = f.get_bool("norm_topk_prob", true);
  c.rms_norm_eps = f.get_double("rms_norm_eps", 1e-6);
  c.rope_interleave = f.get_bool("rope_interleave", true);
  c.rope = parse_rope_config(config, where);
  c.max_position_embeddings = f.get_int("max_position_embeddings", 4096);
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", false);
  c.bos_token_id = f.json().contains("bos_token_id") ? f.get_optional_int("bos_token_id").value_or(-1) : 0;
  if (f.has("eos_token_id") && f.json()["eos_token_id"].is_array()) {
    auto ids = f.get_int_list("eos_token_id");
    c.eos_token_id = ids.empty() ? -1 : ids.front();
  } else {
    c.eos_token_id = f.json().contains("eos_token_id") ? f.get_optional_int("eos_token_id").value_or(-1) : 1;
  }
  c.n_nextn_predict_layers = f.get_int("num_nextn_predict_layers", 0);

  std::string scoring = f.get_string("scoring_func", "sigmoid");
  BG_CHECK(scoring == "sigmoid", "{}: scoring_func '{}' is not supported (sigmoid)", where, scoring);
  std::string act = f.get_string("hidden_act", "silu");
  BG_CHECK(act == "silu", "{}: hidden_act '{}' is not supported for deepseek_v3 (silu)", where, act);
  BG_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.n_layers > 0 && c.n_heads > 0, "{}: vocab_size, hidden_size, "
           "num_hidden_layers and num_attention_heads must be positive", where);
  BG_CHECK(c.kv_lora_rank > 0 && c.qk_nope_head_dim > 0 && c.v_head_dim > 0 && c.qk_rope_head_dim >= 0,
           "{}: MLA dims must be positive", where);
  BG_CHECK(c.qk_rope_head_dim % 2 == 0, "{}: qk_rope_head_dim {} must be even", where, c.qk_rope_head_dim);
  BG_CHECK(c.q_lora_rank >= 0, "{}: q_lora_rank {} must be null or positive", where, c.q_lora_rank);
  BG_CHECK(c.moe_layer_freq > 0, "{}: moe_layer_freq must be positive", where);
  if (c.n_routed_experts > 0) {
    BG_CHECK(c.moe_intermediate_size > 0, "{}: moe_intermediate_size must be positive", where);
    BG_CHECK(c.n_experts_per_tok > 0 && c.n_experts_per_tok <= c.n_routed_experts,
             "{}: num_experts_per_tok {} must be in [1, n_routed_experts={}]", where, c.n_experts_per_tok,
             c.n_routed_experts);
    BG_CHECK(c.n_group > 0 && c.n_routed_experts % c.n_group == 0, "{}: n_routed_experts {} is not divisible by "
             "n_group {}", where, c.n_routed_experts, c.n_group);
    BG_CHECK(c.topk_group > 0 && c.topk_group <= c.n_group, "{}: topk_group {} must be in [1, n_group={}]", where,
             c.topk_group, c.n_group);
    BG_CHECK(c.n_experts_per_tok <= c.topk_group * (c.n_routed_experts / c.n_group),
             "{}: num_experts_per_tok {} exceeds the experts in topk_group groups", where, c.n_experts_per_tok);
    BG_CHECK(c.n_routed_experts / c.n_group >= 2 || c.n_group == 1, "{}: grouped routing needs >= 2 experts per "
             "group", where);
  }
  return c;
}

DeepseekV3Config load_deepseek_v3_config(const std::filesystem::path& model_dir) {
  auto path = model_dir / "config.json";
  auto j = read_json_file(path);
  return parse_deepseek_v3_config(j, path.string());
}

}  // namespace bg

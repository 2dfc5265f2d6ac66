// Kimi-K3 config.json parsing and validation.
#include "formats/kimi_k3_config.h"

#include "core/error.h"
#include "formats/json_fields.h"

namespace bg {
namespace {

int64_t eos_id(const JsonFields& f) {
  if (f.has("eos_token_id") && f.json()["eos_token_id"].is_array()) {
    auto ids = f.get_int_list("eos_token_id");
    return ids.empty() ? -1 : ids.front();
  }
  return f.get_optional_int("eos_token_id").value_or(-1);
}

void parse_schedule(const JsonFields& lin, KimiK3Config& c) {
  auto full = lin.get_int_list("full_attn_layers");
  auto kda = lin.get_int_list("kda_layers");
  std::vector<int> seen(static_cast<size_t>(c.n_layers), 0);
  c.layer_kinds.assign(static_cast<size_t>(c.n_layers), K3LayerKind::kKda);
  auto mark = [&](const std::vector<int64_t>& ids, K3LayerKind kind, const char* key) {
    for (int64_t one_based : ids) {
      BG_CHECK(one_based >= 1 && one_based <= c.n_layers, "{}: {} entry {} is outside 1..{} (the lists are 1-based)",
               lin.where(), key, one_based, c.n_layers);
      auto i = static_cast<size_t>(one_based - 1);
      BG_CHECK(seen[i] == 0, "{}: layer {} is listed twice in full_attn_layers/kda_layers", lin.where(), one_based);
      seen[i] = 1;
      c.layer_kinds[i] = kind;
    }
  };
  mark(full, K3LayerKind::kMla, "full_attn_layers");
  mark(kda, K3LayerKind::kKda, "kda_layers");
  for (int64_t l = 0; l < c.n_layers; ++l) {
    BG_CHECK(seen[static_cast<size_t>(l)] == 1, "{}: layer {} (1-based) is in neither full_attn_layers nor kda_layers",
             lin.where(), l + 1);
  }
}

}  // namespace

KimiK3Config parse_kimi_k3_config(const nlohmann::json& config, const std::string& where) {
  JsonFields top(config, where);
  const bool wrapped = top.has("text_config");
  JsonFields f = wrapped ? top.object("text_config") : top;
  KimiK3Config c;
  c.tensor_prefix = wrapped ? "language_model." : "";
  c.vocab_size = f.get_int("vocab_size");
  c.hidden_size = f.get_int("hidden_size");
  c.intermediate_size = f.get_int("intermediate_size");
  c.n_layers = f.get_int("num_hidden_layers");
  c.n_heads = f.get_int("num_attention_heads");
  c.q_lora_rank = f.get_optional_int("q_lora_rank").value_or(0);
  c.kv_lora_rank = f.get_int("kv_lora_rank");
  c.qk_nope_head_dim = f.get_int("qk_nope_head_dim");
  c.qk_rope_head_dim = f.get_int("qk_rope_head_dim");
  c.v_head_dim = f.get_int("v_head_dim");
  BG_CHECK(f.get_bool("mla_use_nope", false), "{}: mla_use_nope must be true (Kimi-K3 MLA has no RoPE)", f.where());
  c.mla_output_gate = f.get_bool("mla_use_output_gate", false);
  JsonFields lin = f.object("linear_attn_config");
  c.kda_heads = lin.get_int("num_heads");
  c.kda_head_dim = lin.get_int("head_dim");
  c.conv_kernel = lin.get_int("short_conv_kernel_size", 4);
  c.gate_lower_bound = lin.get_double("gate_lower_bound");
  BG_CHECK(lin.get_bool("use_full_rank_gate", true), "{}: use_full_rank_gate=false is not supported", lin.where());
  std::string act = f.get_string("hidden_act");
  BG_CHECK(act == "situ", "{}: hidden_act '{}' is not supported for kimi_k3 (situ)", f.where(), act);
  c.situ_beta = f.get_double("activation_situ_beta");
  c.situ_linear_beta = f.get_double("activation_situ_linear_beta");
  c.first_k_dense_replace = f.get_int("first_k_dense_replace", 1);
  c.moe_layer_freq = f.get_int("moe_layer_freq", 1);
  c.n_experts = f.get_int("num_experts");
  c.n_experts_per_token = f.get_int("num_experts_per_token");
  c.moe_intermediate_size = f.get_int("moe_intermediate_size");
  c.latent_size = f.get_int("routed_expert_hidden_size");
  c.latent_norm = f.get_bool("latent_moe_use_norm", true);
  c.n_shared_experts = f.get_int("num_shared_experts", 0);
  std::string router_act = f.get_string("moe_router_activation_func", "sigmoid");
  BG_CHECK(router_act == "sigmoid", "{}: moe_router_activation_func '{}' is not supported (sigmoid)", f.where(),
           router_act);
  if (f.get_bool("use_grouped_topk", false)) {
    c.n_group = f.get_int("num_expert_group", 1);
    c.topk_group = f.get_int("topk_group", 1);
  }
  c.renormalize = f.get_bool("moe_renormalize", true);
  c.routed_scaling_factor = f.get_double("routed_scaling_factor", 1.0);
  c.attn_res_block_size = f.get_int("attn_res_block_size");
  c.rms_norm_eps = f.get_double("rms_norm_eps", 1e-5);
  c.max_position_embeddings = f.get_int("max_position_embeddings");
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", top.get_bool("tie_word_embeddings", false));
  c.bos_token_id = top.get_optional_int("bos_token_id").value_or(f.get_optional_int("bos_token_id").value_or(-1));
  c.eos_token_id = top.has("eos_token_id") ? eos_id(top) : eos_id(f);

  BG_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.n_layers > 0, "{}: vocab_size, hidden_size and "
           "num_hidden_layers must be positive", f.where());
  BG_CHECK(c.n_heads > 0 && c.kv_lora_rank > 0 && c.qk_nope_head_dim > 0 && c.v_head_dim > 0 &&
               c.qk_rope_head_dim >= 0 && c.q_lora_rank >= 0,
           "{}: MLA dims must be positive", f.where());
  BG_CHECK(c.kda_heads > 0 && c.kda_head_dim > 0 && c.conv_kernel >= 1, "{}: KDA num_heads, head_dim and "
           "short_conv_kernel_size must be positive", lin.where());
  BG_CHECK(c.attn_res_block_size > 0, "{}: attn_res_block_size must be positive", f.where());
  BG_CHECK(c.moe_layer_freq > 0, "{}: moe_layer_freq must be positive", f.where());
  BG_CHECK(c.n_experts >= 0 && c.moe_intermediate_size > 0 && c.latent_size > 0 && c.n_shared_experts >= 0,
           "{}: MoE sizes must be positive", f.where());
  BG_CHECK(c.n_experts == 0 || (c.n_experts_per_token >= 1 && c.n_experts_per_token <= c.n_experts),
           "{}: num_experts_per_token {} must be in [1, num_experts={}]", f.where(), c.n_experts_per_token,
           c.n_experts);
  BG_CHECK(c.n_group >= 1 && c.n_experts % c.n_group == 0 && c.topk_group >= 1 && c.topk_group <= c.n_group,
           "{}: expert grouping {} experts / {} groups / keep {} is invalid", f.where(), c.n_experts, c.n_group,
           c.topk_group);
  parse_schedule(lin, c);
  return c;
}

}  // namespace bg

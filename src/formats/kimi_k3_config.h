// Parsed Kimi-K3 config.json: the wrapper (model_type kimi_k3) with the language model under `text_config`
// (kimi_linear). Layer schedule from linear_attn_config's 1-based lists, never from i % 4.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bg {

enum class K3LayerKind : uint8_t { kKda, kMla };

struct KimiK3Config {
  std::string tensor_prefix;  // "language_model." under the kimi_k3 wrapper
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense layers
  int64_t n_layers = 0;
  std::vector<K3LayerKind> layer_kinds;  // [n_layers]
  // MLA (NoPE, output gate)
  int64_t n_heads = 0;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;  // the un-rotated "pe" part
  int64_t v_head_dim = 0;
  bool mla_output_gate = true;
  // KDA
  int64_t kda_heads = 0;
  int64_t kda_head_dim = 0;
  int64_t conv_kernel = 4;
  double gate_lower_bound = -5.0;
  // MLP / MoE
  double situ_beta = 4.0;
  double situ_linear_beta = 25.0;
  int64_t first_k_dense_replace = 1;
  int64_t moe_layer_freq = 1;
  int64_t n_experts = 0;
  int64_t n_experts_per_token = 0;
  int64_t moe_intermediate_size = 0;
  int64_t latent_size = 0;  // routed_expert_hidden_size
  bool latent_norm = true;
  int64_t n_shared_experts = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool renormalize = true;
  double routed_scaling_factor = 1.0;
  // Attention residuals, norms, limits
  int64_t attn_res_block_size = 0;
  double rms_norm_eps = 1e-5;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;

  int64_t kda_proj_dim() const { return kda_heads * kda_head_dim; }
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kv_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }
  bool is_moe_layer(int64_t l) const {
    return n_experts > 0 && l >= first_k_dense_replace && l % moe_layer_freq == 0;
  }
  bool is_mla(int64_t l) const { return layer_kinds[static_cast<size_t>(l)] == K3LayerKind::kMla; }
};

KimiK3Config parse_kimi_k3_config(const nlohmann::json& config, const std::string& where);

}  // namespace bg

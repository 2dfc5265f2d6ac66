// Parsed config.json of the supported architectures. Every field is read from the file (never hard-coded); missing
// optional fields take the Hugging Face defaults.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace bg {

// RoPE parameters after transformers' normalisation (legacy `rope_scaling` or v5 `rope_parameters`).
struct RopeConfig {
  std::string type = "default";  // "default" or "yarn"
  double theta = 10000.0;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;  // 0: absent (transformers treats a falsy mscale as unset)
  double mscale_all_dim = 0.0;
  std::optional<double> attention_factor;
  bool truncate = true;
};

struct DeepseekV3Config {
  std::string model_type;  // deepseek_v3 | kimi_k2
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP
  int64_t moe_intermediate_size = 0;  // per routed expert
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t q_lora_rank = 0;  // 0: no q-LoRA (single q_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 0;
  int64_t n_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double routed_scaling_factor = 1.0;
  bool norm_topk_prob = true;
  double rms_norm_eps = 1e-6;
  bool rope_interleave = true;
  RopeConfig rope;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  int64_t n_nextn_predict_layers = 0;

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kv_cache_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // 576 for DeepSeek-V3
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
};

// The architecture a checkpoint declares (config.json model_type / architectures).
enum class Arch { kDeepseekV3, kKimiK3 };
Arch detect_arch(const nlohmann::json& config, const std::string& where);

RopeConfig parse_rope_config(const nlohmann::json& config, const std::string& where);
DeepseekV3Config parse_deepseek_v3_config(const nlohmann::json& config, const std::string& where);
DeepseekV3Config load_deepseek_v3_config(const std::filesystem::path& model_dir);

}  // namespace bg

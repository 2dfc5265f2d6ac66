// The Kimi-K3 tensor table (names, shapes and dtypes of the published checkpoint; see docs kimi_k3.md section 3).
#include "model/kimi_k3.h"

namespace bg {

ArchTable kimi_k3_table(const KimiK3Config& c) {
  using T = K3Tensor;
  const std::vector<DType> kFloat = {DType::kF32, DType::kBF16, DType::kF16};
  const int64_t H = c.hidden_size, P = c.kda_proj_dim(), nh = c.n_heads;
  const int64_t shared_inter = c.n_shared_experts * c.moe_intermediate_size;
  auto fixed = [](Shape s) { return [s](int64_t) { return s; }; };
  auto kda = [c](int64_t l) { return !c.is_mla(l); };
  auto mla = [c](int64_t l) { return c.is_mla(l); };
  auto mla_q_lora = [c](int64_t l) { return c.is_mla(l) && c.q_lora_rank > 0; };
  auto mla_q_plain = [c](int64_t l) { return c.is_mla(l) && c.q_lora_rank == 0; };
  auto mla_gate = [c](int64_t l) { return c.is_mla(l) && c.mla_output_gate; };
  auto dense = [c](int64_t l) { return !c.is_moe_layer(l); };
  auto moe = [c](int64_t l) { return c.is_moe_layer(l); };
  auto moe_norm = [c](int64_t l) { return c.is_moe_layer(l) && c.latent_norm; };
  auto shared = [c](int64_t l) { return c.is_moe_layer(l) && c.n_shared_experts > 0; };
  const std::string M = c.tensor_prefix + "model.";
  const std::string L = M + "layers.{L}.";
  const std::string A = L + "self_attn.";
  const std::string E = L + "block_sparse_moe.";
  const auto lin = TensorKind::kLinear;
  const auto ten = TensorKind::kTensor;

  ArchTable t;
  t.arch = "kimi_k3";
  t.n_layers = c.n_layers;
  t.n_experts = c.n_experts;
  t.specs = {
      {int(T::kEmbed), M + "embed_tokens.weight", ten, Scope::kGlobal, kFloat, {}, fixed({c.vocab_size, H})},
      {int(T::kFinalNorm), M + "norm.weight", ten, Scope::kGlobal, kFloat, {}, fixed({H})},
      {int(T::kOutResNorm), M + "output_attn_res_norm.weight", ten, Scope::kGlobal, kFloat, {}, fixed({H})},
      {int(T::kOutResProj), M + "output_attn_res_proj.weight", ten, Scope::kGlobal, kFloat, {}, fixed({1, H})},
      {int(T::kInputNorm), L + "input_layernorm.weight", ten, Scope::kLayer, kFloat, {}, fixed({H})},
      {int(T::kPostAttnNorm), L + "post_attention_layernorm.weight", ten, Scope::kLayer, kFloat, {}, fixed({H})},
      {int(T::kAttnResNorm), L + "self_attention_res_norm.weight", ten, Scope::kLayer, kFloat, {}, fixed({H})},
      {int(T::kAttnResProj), L + "self_attention_res_proj.weight", ten, Scope::kLayer, kFloat, {}, fixed({1, H})},
      {int(T::kMlpResNorm), L + "mlp_res_norm.weight", ten, Scope::kLayer, kFloat, {}, fixed({H})},
      {int(T::kMlpResProj), L + "mlp_res_proj.weight", ten, Scope::kLayer, kFloat, {}, fixed({1, H})},
      // KDA
      {int(T::kKdaQ), A + "q_proj", lin, Scope::kLayer, {}, kda, fixed({P, H})},
      {int(T::kKdaK), A + "k_proj", lin, Scope::kLayer, {}, kda, fixed({P, H})},
      {int(T::kKdaV), A + "v_proj", lin, Scope::kLayer, {}, kda, fixed({P, H})},
      {int(T::kKdaG), A + "g_proj", lin, Scope::kLayer, {}, kda, fixed({P, H})},
      {int(T::kKdaO), A + "o_proj", lin, Scope::kLayer, {}, kda, fixed({H, P})},
      {int(T::kKdaFA), A + "f_a_proj", lin, Scope::kLayer, {}, kda, fixed({c.kda_head_dim, H})},
      {int(T::kKdaFB), A + "f_b_proj", lin, Scope::kLayer, {}, kda, fixed({P, c.kda_head_dim})},
      {int(T::kKdaB), A + "b_proj", lin, Scope::kLayer, {}, kda, fixed({c.kda_heads, H})},
      {int(T::kKdaQConv), A + "q_conv1d.weight", ten, Scope::kLayer, kFloat, kda, fixed({P, 1, c.conv_kernel})},
      {int(T::kKdaKConv), A + "k_conv1d.weight", ten, Scope::kLayer, kFloat, kda, fixed({P, 1, c.conv_kernel})},
      {int(T::kKdaVConv), A + "v_conv1d.weight", ten, Scope::kLayer, kFloat, kda, fixed({P, 1, c.conv_kernel})},
      // A_log is stored wider than the head count (real: [128] for 96 heads); the model checks and narrows it.
      {int(T::kKdaALog), A + "A_log", ten, Scope::kLayer, kFloat, kda, {}},
      {int(T::kKdaDtBias), A + "dt_bias", ten, Scope::kLayer, kFloat, kda, fixed({P})},
      {int(T::kKdaONorm), A + "o_norm.weight", ten, Scope::kLayer, kFloat, kda, fixed({c.kda_head_dim})},
      // MLA
      {int(T::kMlaQA), A + "q_a_proj", lin, Scope::kLayer, {}, mla_q_lora, fixed({c.q_lora_rank, H})},
      {int(T::kMlaQANorm), A + "q_a_layernorm.weight", ten, Scope::kLayer, kFloat, mla_q_lora, fixed({c.q_lora_rank})},
      {int(T::kMlaQB), A + "q_b_proj", lin, Scope::kLayer, {}, mla_q_lora, fixed({nh * c.qk_head_dim(), c.q_lora_rank})},
      {int(T::kMlaQ), A + "q_proj", lin, Scope::kLayer, {}, mla_q_plain, fixed({nh * c.qk_head_dim(), H})},
      {int(T::kMlaKvA), A + "kv_a_proj_with_mqa", lin, Scope::kLayer, {}, mla, fixed({c.kv_cache_dim(), H})},
      {int(T::kMlaKvANorm), A + "kv_a_layernorm.weight", ten, Scope::kLayer, kFloat, mla, fixed({c.kv_lora_rank})},
      {int(T::kMlaKvB), A + "kv_b_proj", lin, Scope::kLayer, {}, mla,
       fixed({nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank})},
      {int(T::kMlaG), A + "g_proj", lin, Scope::kLayer, {}, mla_gate, fixed({nh * c.v_head_dim, H})},
      {int(T::kMlaO), A + "o_proj", lin, Scope::kLayer, {}, mla, fixed({H, nh * c.v_head_dim})},
      // Dense MLP (layer 0)
      {int(T::kMlpGate), L + "mlp.gate_proj", lin, Scope::kLayer, {}, dense, fixed({c.intermediate_size, H})},
      {int(T::kMlpUp), L + "mlp.up_proj", lin, Scope::kLayer, {}, dense, fixed({c.intermediate_size, H})},
      {int(T::kMlpDown), L + "mlp.down_proj", lin, Scope::kLayer, {}, dense, fixed({H, c.intermediate_size})},
      // Latent MoE
      {int(T::kRouterGate), E + "gate", lin, Scope::kLayer, {}, moe, fixed({c.n_experts, H})},
      {int(T::kRouterBias), E + "gate.e_score_correction_bias", ten, Scope::kLayer, kFloat, moe, fixed({c.n_experts})},
      {int(T::kLatentDown), E + "routed_expert_down_proj", lin, Scope::kLayer, {}, moe, fixed({c.latent_size, H})},
      {int(T::kLatentNorm), E + "routed_expert_norm.weight", ten, Scope::kLayer, kFloat, moe_norm,
       fixed({c.latent_size})},
      {int(T::kLatentUp), E + "routed_expert_up_proj", lin, Scope::kLayer, {}, moe, fixed({H, c.latent_size})},
      {int(T::kSharedGate), E + "shared_experts.gate_proj", lin, Scope::kLayer, {}, shared, fixed({shared_inter, H})},
      {int(T::kSharedUp), E + "shared_experts.up_proj", lin, Scope::kLayer, {}, shared, fixed({shared_inter, H})},
      {int(T::kSharedDown), E + "shared_experts.down_proj", lin, Scope::kLayer, {}, shared, fixed({H, shared_inter})},
      {int(T::kExpertW1), E + "experts.{E}.w1", lin, Scope::kExpert, {}, moe,
       fixed({c.moe_intermediate_size, c.latent_size})},
      {int(T::kExpertW3), E + "experts.{E}.w3", lin, Scope::kExpert, {}, moe,
       fixed({c.moe_intermediate_size, c.latent_size})},
      {int(T::kExpertW2), E + "experts.{E}.w2", lin, Scope::kExpert, {}, moe,
       fixed({c.latent_size, c.moe_intermediate_size})},
  };
  if (!c.tie_word_embeddings) {
    t.specs.push_back({int(T::kLmHead), c.tensor_prefix + "lm_head", lin, Scope::kGlobal, {}, {}, fixed({c.vocab_size, H})});
  }
  // The vision tower and projector are not part of the text model.
  t.skip = [](const std::string& name) {
    return name.rfind("vision_tower.", 0) == 0 || name.rfind("mm_projector.", 0) == 0;
  };
  return t;
}

}  // namespace bg

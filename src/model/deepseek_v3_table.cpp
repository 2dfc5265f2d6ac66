// The DeepSeek-V3 tensor table (checkpoint names as published, HF layout).
#include <regex>

#include "model/deepseek_v3.h"

namespace bg {

ArchTable deepseek_v3_table(const DeepseekV3Config& c) {
  using T = DsTensor;
  const std::vector<DType> kFloat = {DType::kF32, DType::kBF16, DType::kF16};
  const int64_t H = c.hidden_size, nh = c.n_heads;
  auto fixed = [](Shape s) { return [s](int64_t) { return s; }; };
  auto dense = [c](int64_t l) { return !c.is_moe_layer(l); };
  auto moe = [c](int64_t l) { return c.is_moe_layer(l); };
  auto has_q_lora = [c](int64_t) { return c.q_lora_rank > 0; };
  auto no_q_lora = [c](int64_t) { return c.q_lora_rank == 0; };
  auto has_shared = [c](int64_t l) { return c.is_moe_layer(l) && c.n_shared_experts > 0; };
  const int64_t shared_inter = c.moe_intermediate_size * c.n_shared_experts;
  const std::string L = "model.layers.{L}.";

  ArchTable t;
  t.arch = "deepseek_v3";
  t.n_layers = c.n_layers;
  t.n_experts = c.n_routed_experts;
  t.specs = {
      {int(T::kEmbed), "model.embed_tokens.weight", TensorKind::kTensor, Scope::kGlobal, kFloat, {}, fixed({c.vocab_size, H})},
      {int(T::kFinalNorm), "model.norm.weight", TensorKind::kTensor, Scope::kGlobal, kFloat, {}, fixed({H})},
      {int(T::kInputNorm), L + "input_layernorm.weight", TensorKind::kTensor, Scope::kLayer, kFloat, {}, fixed({H})},
      {int(T::kPostAttnNorm), L + "post_attention_layernorm.weight", TensorKind::kTensor, Scope::kLayer, kFloat, {},
       fixed({H})},
      {int(T::kQProj), L + "self_attn.q_proj", TensorKind::kLinear, Scope::kLayer, {}, no_q_lora,
       fixed({nh * c.qk_head_dim(), H})},
      {int(T::kQAProj), L + "self_attn.q_a_proj", TensorKind::kLinear, Scope::kLayer, {}, has_q_lora,
       fixed({c.q_lora_rank, H})},
      {int(T::kQANorm), L + "self_attn.q_a_layernorm.weight", TensorKind::kTensor, Scope::kLayer, kFloat, has_q_lora,
       fixed({c.q_lora_rank})},
      {int(T::kQBProj), L + "self_attn.q_b_proj", TensorKind::kLinear, Scope::kLayer, {}, has_q_lora,
       fixed({nh * c.qk_head_dim(), c.q_lora_rank})},
      {int(T::kKvAProj), L + "self_attn.kv_a_proj_with_mqa", TensorKind::kLinear, Scope::kLayer, {}, {},
       fixed({c.kv_cache_dim(), H})},
      {int(T::kKvANorm), L + "self_attn.kv_a_layernorm.weight", TensorKind::kTensor, Scope::kLayer, kFloat, {},
       fixed({c.kv_lora_rank})},
      {int(T::kKvBProj), L + "self_attn.kv_b_proj", TensorKind::kLinear, Scope::kLayer, {}, {},
       fixed({nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank})},
      {int(T::kOProj), L + "self_attn.o_proj", TensorKind::kLinear, Scope::kLayer, {}, {}, fixed({H, nh * c.v_head_dim})},
      {int(T::kMlpGate), L + "mlp.gate_proj", TensorKind::kLinear, Scope::kLayer, {}, dense,
       fixed({c.intermediate_size, H})},
      {int(T::kMlpUp), L + "mlp.up_proj", TensorKind::kLinear, Scope::kLayer, {}, dense, fixed({c.intermediate_size, H})},
      {int(T::kMlpDown), L + "mlp.down_proj", TensorKind::kLinear, Scope::kLayer, {}, dense,
       fixed({H, c.intermediate_size})},
      {int(T::kRouterGate), L + "mlp.gate", TensorKind::kLinear, Scope::kLayer, {}, moe, fixed({c.n_routed_experts, H})},
      {int(T::kRouterBias), L + "mlp.gate.e_score_correction_bias", TensorKind::kTensor, Scope::kLayer, kFloat, moe,
       fixed({c.n_routed_experts})},
      {int(T::kExpertGate), L + "mlp.experts.{E}.gate_proj", TensorKind::kLinear, Scope::kExpert, {}, moe,
       fixed({c.moe_intermediate_size, H})},
      {int(T::kExpertUp), L + "mlp.experts.{E}.up_proj", TensorKind::kLinear, Scope::kExpert, {}, moe,
       fixed({c.moe_intermediate_size, H})},
      {int(T::kExpertDown), L + "mlp.experts.{E}.down_proj", TensorKind::kLinear, Scope::kExpert, {}, moe,
       fixed({H, c.moe_intermediate_size})},
      {int(T::kSharedGate), L + "mlp.shared_experts.gate_proj", TensorKind::kLinear, Scope::kLayer, {}, has_shared,
       fixed({shared_inter, H})},
      {int(T::kSharedUp), L + "mlp.shared_experts.up_proj", TensorKind::kLinear, Scope::kLayer, {}, has_shared,
       fixed({shared_inter, H})},
      {int(T::kSharedDown), L + "mlp.shared_experts.down_proj", TensorKind::kLinear, Scope::kLayer, {}, has_shared,
       fixed({H, shared_inter})},
  };
  if (!c.tie_word_embeddings) {
    t.specs.push_back({int(T::kLmHead), "lm_head", TensorKind::kLinear, Scope::kGlobal, {}, {}, fixed({c.vocab_size, H})});
  }
  // Multi-token-prediction layers (model.layers.{n_layers..}) are not used for decoding, as in transformers.
  const int64_t n_layers = c.n_layers;
  t.skip = [n_layers](const std::string& name) {
    static const std::regex layer_re(R"(^model\.layers\.(\d+)\.)");
    std::smatch m;
    return std::regex_search(name, m, layer_re) && std::stoll(m[1].str()) >= n_layers;
  };
  return t;
}

}  // namespace bg

// DeepSeek-V3 for make-random: presets, the transformers-5 style config.json, and the per-tensor storage and init
// policy (which linears are quantized in each format, which tensors stay F32, how large the random values are).
#include <cmath>

#include "core/error.h"
#include "formats/model_config.h"
#include "model/deepseek_v3.h"
#include "model/random_checkpoint.h"

namespace bg {
namespace {

using nlohmann::json;
using T = DsTensor;

struct DsPreset {
  const char* name;
  int64_t hidden, n_layers, n_heads, q_lora, kv_lora, nope, rope, v_head;
  int64_t n_experts, top_k, n_shared, moe_inter, inter, vocab, first_dense, n_group, topk_group;
  int64_t max_positions, yarn_original;
  double yarn_factor;
};

// tiny: the dims of shared/golden/deepseek_v3/tiny-*. small: more layers and experts, grouped routing, a larger
// vocabulary; still a few MB.
constexpr DsPreset kPresets[] = {
    {"tiny", 128, 4, 4, 64, 32, 16, 16, 16, 16, 4, 1, 64, 256, 512, 1, 1, 1, 512, 64, 8.0},
    {"small", 256, 6, 8, 96, 64, 32, 16, 32, 32, 6, 1, 32, 512, 2048, 1, 4, 2, 1024, 128, 8.0},
};

const DsPreset& preset_by_name(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name == p.name) return p;
  }
  fail("deepseek_v3: unknown preset '{}'", name);
}

// The fields transformers 5.x writes for DeepseekV3Config (as in shared/golden/deepseek_v3/tiny-fp32/model).
json preset_config(const std::string& name) {
  const DsPreset& p = preset_by_name(name);
  json c = {
      {"_name_or_path", ""},
      {"architectures", {"DeepseekV3ForCausalLM"}},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"bos_token_id", 0},
      {"chunk_size_feed_forward", 0},
      {"dtype", nullptr},
      {"eos_token_id", 1},
      {"first_k_dense_replace", p.first_dense},
      {"hidden_act", "silu"},
      {"hidden_size", p.hidden},
      {"id2label", {{"0", "LABEL_0"}, {"1", "LABEL_1"}}},
      {"initializer_range", 0.05},
      {"intermediate_size", p.inter},
      {"is_encoder_decoder", false},
      {"kv_lora_rank", p.kv_lora},
      {"label2id", {{"LABEL_0", 0}, {"LABEL_1", 1}}},
      {"max_position_embeddings", p.max_positions},
      {"model_type", "deepseek_v3"},
      {"moe_intermediate_size", p.moe_inter},
      {"n_group", p.n_group},
      {"n_routed_experts", p.n_experts},
      {"n_shared_experts", p.n_shared},
      {"norm_topk_prob", true},
      {"num_attention_heads", p.n_heads},
      {"num_experts_per_tok", p.top_k},
      {"num_hidden_layers", p.n_layers},
      {"num_key_value_heads", p.n_heads},
      {"num_nextn_predict_layers", 0},  // no MTP layer is written
      {"output_attentions", false},
      {"output_hidden_states", false},
      {"pad_token_id", nullptr},
      {"pretraining_tp", 1},
      {"problem_type", nullptr},
      {"q_lora_rank", p.q_lora},
      {"qk_nope_head_dim", p.nope},
      {"qk_rope_head_dim", p.rope},
      {"return_dict", true},
      {"rms_norm_eps", 1e-6},
      {"rope_interleave", true},
      {"rope_parameters",
       {{"beta_fast", 1.0}, {"beta_slow", 1.0}, {"factor", p.yarn_factor}, {"mscale", 1.0}, {"mscale_all_dim", 1.0},
        {"original_max_position_embeddings", p.yarn_original}, {"rope_theta", 50000.0}, {"rope_type", "yarn"}}},
      {"routed_scaling_factor", 2.5},
      {"tie_word_embeddings", false},
      {"topk_group", p.topk_group},
      {"transformers_version", "5.17.0"},
      {"use_cache", true},
      {"v_head_dim", p.v_head},
      {"vocab_size", p.vocab},
  };
  return c;
}

// head_dim (= qk_rope_head_dim, what RoPE rotates), qk_head_dim and num_key_value_heads (MLA has no GQA) follow the
// (patched) dims; the format decides dtype and quantization_config.
void finalize_config(json& c, RandomWeightFormat format) {
  if (c.contains("num_attention_heads")) c["num_key_value_heads"] = c["num_attention_heads"];
  if (c.contains("qk_rope_head_dim") && c["qk_rope_head_dim"].is_number_integer()) {
    c["head_dim"] = c["qk_rope_head_dim"];
    if (c.contains("qk_nope_head_dim") && c["qk_nope_head_dim"].is_number_integer()) {
      c["qk_head_dim"] = c["qk_nope_head_dim"].get<int64_t>() + c["qk_rope_head_dim"].get<int64_t>();
    }
  }
  c["dtype"] = format == RandomWeightFormat::kF32 ? "float32" : "bfloat16";
  c.erase("quantization_config");
  if (format == RandomWeightFormat::kFp8) {
    c["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                {"weight_block_size", {128, 128}}};
  } else if (format == RandomWeightFormat::kMxfp4) {
    c["quantization_config"] = {
        {"block_size", 32},
        {"quant_method", "mxfp4"},
        {"quantized", "routed experts: <name>_blocks uint8 [out, in/32, 16] (low nibble = even element), "
                      "<name>_scales uint8 [out, in/32]"},
        {"scale_format", "e8m0"}};
  }
}

bool is_routed_expert(T id) { return id == T::kExpertGate || id == T::kExpertUp || id == T::kExpertDown; }

// Output std (for unit-RMS inputs) of each linear: q and k large enough that attention is far from uniform, so RoPE
// positions matter; router logits spread over about +-1 so sigmoid scores (and the expert choice) differ; logits with
// a std of about 3 so greedy choices have clear margins.
double linear_gain(T id) {
  switch (id) {
    case T::kQProj:
    case T::kQBProj:
    case T::kKvAProj:
    case T::kKvBProj: return 1.5;
    case T::kLmHead: return 3.0;
    default: return 1.0;
  }
}

TensorPlan plan_tensor(const TensorSpec& spec, const Shape& shape, RandomWeightFormat format) {
  const T id = static_cast<T>(spec.id);
  TensorPlan p;
  p.dtype = format == RandomWeightFormat::kF32 ? DType::kF32 : DType::kBF16;
  if (spec.kind == TensorKind::kTensor) {
    switch (id) {
      case T::kEmbed: p.std = 1.0; return p;
      case T::kRouterBias:  // selection-only bias, kept in F32 as published checkpoints do
        p.dtype = DType::kF32;
        p.std = 0.05;
        return p;
      case T::kFinalNorm:
      case T::kInputNorm:
      case T::kPostAttnNorm:
      case T::kQANorm:
      case T::kKvANorm:
        p.mean = 1.0;
        p.std = 0.1;
        return p;
      default: fail("deepseek_v3 make-random: no init rule for tensor '{}'", spec.pattern);
    }
  }
  p.std = linear_gain(id) / std::sqrt(static_cast<double>(shape.at(1)));
  const bool keep_dense = id == T::kLmHead || id == T::kRouterGate;  // embed is a kTensor, never quantized
  if (format == RandomWeightFormat::kFp8 && !keep_dense) p.format = WeightFormat::kFp8Block;
  if (format == RandomWeightFormat::kMxfp4 && is_routed_expert(id)) p.format = WeightFormat::kMxfp4;
  return p;
}

}  // namespace

RandomArch deepseek_v3_random_arch() {
  RandomArch a;
  a.name = "deepseek_v3";
  for (const auto& p : kPresets) a.presets.emplace_back(p.name);
  a.preset_config = preset_config;
  a.finalize_config = finalize_config;
  a.table = [](const json& config, const std::string& where) {
    return deepseek_v3_table(parse_deepseek_v3_config(config, where));
  };
  a.policy = plan_tensor;
  return a;
}

}  // namespace bg

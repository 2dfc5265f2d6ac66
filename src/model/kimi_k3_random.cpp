// Kimi-K3 for make-random: presets, the config.json of the published checkpoint (kimi_k3 wrapper, kimi_linear
// text_config, vision stub, compressed-tensors quantization_config), and the per-tensor storage and init policy.
#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.h"
#include "formats/kimi_k3_config.h"
#include "model/kimi_k3.h"
#include "model/random_checkpoint.h"

namespace bg {
namespace {

using nlohmann::json;
using T = K3Tensor;

struct K3Preset {
  const char* name;
  int64_t hidden, n_layers;
  std::vector<int64_t> full_attn_layers;  // 1-based MLA layers; every other layer is KDA
  int64_t kda_heads, kda_head_dim;
  int64_t n_heads, q_lora, kv_lora, nope, rope, v_head;
  int64_t n_experts, top_k, n_shared, latent, moe_inter, inter;
  int64_t attn_res_block, vocab, max_positions;
};

// tiny: the dims of shared/golden/kimi_k3/k3-tiny (its config.json, field for field).
// ep16-rank: the real dims (docs/kimi_k3.md section 1) on 4 layers (K K K M) and 56 experts, the experts one rank
// holds in a 16-way expert-parallel deployment (896 / 16). top-k stays 16: with balanced routing each rank of EP16
// receives 16 x 56 / 896 x 16 ranks = 16 expert rows per local token, exactly what top-16 of 56 local experts gives,
// so the expert FLOPs, the rows per expert and the expert weight traffic per local token are those of the real
// deployment (top-1, the local share of one token's 16 experts, would ignore the tokens other ranks send). Dense
// layer 0, the full 163840 vocabulary and AttnRes block 12 (one bank) as in the real model; writes 13.3 GB in mxfp4
// (random_checkpoint_total_bytes; see tests/model/kimi_k3_random_test.cpp). Only for GPU benchmarks, never in CI.
const std::vector<K3Preset>& presets() {
  static const std::vector<K3Preset> p = {
      {"tiny", 128, 10, {3, 6, 9, 10}, 4, 32, 4, 64, 32, 32, 16, 32, 16, 4, 2, 64, 64, 256, 3, 1024, 4096},
      {"ep16-rank", 7168, 4, {4}, 96, 128, 96, 1536, 512, 128, 64, 128, 56, 16, 2, 3584, 3072, 33792, 12, 163840,
       1048576},
  };
  return p;
}

const K3Preset& preset_by_name(const std::string& name) {
  for (const auto& p : presets()) {
    if (name == p.name) return p;
  }
  fail("kimi_k3: unknown preset '{}'", name);
}

// The real checkpoint's quantization_config (top level, as in shared/golden/kimi_k3). Its `ignore` list does not
// name the router and the latent projections although they ship BF16: the loader keys off `.weight_packed`.
json mxfp4_quantization_config() {
  return json::parse(R"({
    "config_groups": {"group_0": {
      "format": "mxfp4-pack-quantized", "input_activations": null, "output_activations": null,
      "targets": ["Linear"],
      "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32, "num_bits": 4,
                  "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
                  "symmetric": true, "type": "float", "zp_dtype": null}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": null,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed"})");
}

json text_config(const K3Preset& p) {
  return {
      {"architectures", {"KimiLinearForCausalLM"}},
      {"model_type", "kimi_linear"},
      {"vocab_size", p.vocab},
      {"hidden_size", p.hidden},
      {"intermediate_size", p.inter},
      {"num_hidden_layers", p.n_layers},
      {"num_attention_heads", p.n_heads},
      {"q_lora_rank", p.q_lora},
      {"kv_lora_rank", p.kv_lora},
      {"qk_nope_head_dim", p.nope},
      {"qk_rope_head_dim", p.rope},
      {"v_head_dim", p.v_head},
      {"mla_use_nope", true},
      {"mla_use_output_gate", true},
      {"linear_attn_config",
       {{"full_attn_layers", p.full_attn_layers}, {"num_heads", p.kda_heads}, {"head_dim", p.kda_head_dim},
        {"short_conv_kernel_size", 4}, {"gate_lower_bound", -5.0}, {"use_full_rank_gate", true}}},
      {"hidden_act", "situ"},
      {"activation_situ_beta", 4.0},
      {"activation_situ_linear_beta", 25.0},
      {"first_k_dense_replace", 1},
      {"moe_layer_freq", 1},
      {"num_experts", p.n_experts},
      {"num_experts_per_token", p.top_k},
      {"moe_intermediate_size", p.moe_inter},
      {"routed_expert_hidden_size", p.latent},
      {"latent_moe_use_norm", true},
      {"num_shared_experts", p.n_shared},
      {"moe_router_activation_func", "sigmoid"},
      {"topk_method", "noaux_tc"},
      {"use_grouped_topk", true},
      {"num_expert_group", 1},
      {"topk_group", 1},
      {"moe_renormalize", true},
      {"routed_scaling_factor", 1.0},
      {"attn_res_block_size", p.attn_res_block},
      {"rms_norm_eps", 1e-5},
      {"max_position_embeddings", p.max_positions},
      {"initializer_range", 0.02},
      {"tie_word_embeddings", false},
      {"use_cache", true},
      {"num_nextn_predict_layers", 0},
      {"top_k", 50},  // a sampling default, not num_experts_per_token
  };
}

json preset_config(const std::string& name) {
  const K3Preset& p = preset_by_name(name);
  return {
      {"architectures", {"KimiK3ForConditionalGeneration"}},
      {"model_type", "kimi_k3"},
      {"tie_word_embeddings", false},
      {"text_config", text_config(p)},
      {"vision_config", {{"patch_size", 14}, {"vt_hidden_size", 1152}, {"vt_num_hidden_layers", 27}}},
  };
}

// kda_layers = every layer not in full_attn_layers; num_key_value_heads = num_attention_heads (MLA); the special ids
// keep the real offsets from the end of the vocabulary (bos V-256, eos = <|end_of_msg|> V-254, pad V-1, media
// placeholder V-235); dtype and quantization_config follow the format.
void finalize_config(json& c, RandomWeightFormat format) {
  if (c.contains("text_config") && c["text_config"].is_object()) {
    json& t = c["text_config"];
    if (t.contains("num_attention_heads")) t["num_key_value_heads"] = t["num_attention_heads"];
    json* lin = t.contains("linear_attn_config") ? &t["linear_attn_config"] : nullptr;
    if (lin != nullptr && lin->is_object() && t.value("num_hidden_layers", json()).is_number_integer() &&
        lin->value("full_attn_layers", json()).is_array()) {
      std::set<int64_t> full;
      for (const auto& v : (*lin)["full_attn_layers"]) {
        if (v.is_number_integer()) full.insert(v.get<int64_t>());
      }
      std::vector<int64_t> kda;
      for (int64_t l = 1; l <= t["num_hidden_layers"].get<int64_t>(); ++l) {
        if (full.count(l) == 0) kda.push_back(l);
      }
      (*lin)["kda_layers"] = kda;
    }
    if (t.value("vocab_size", json()).is_number_integer()) {
      const int64_t V = t["vocab_size"].get<int64_t>();
      for (json* o : {&c, &t}) {
        (*o)["bos_token_id"] = V - 256;
        (*o)["eos_token_id"] = V - 254;
        (*o)["pad_token_id"] = V - 1;
      }
      c["media_placeholder_token_id"] = V - 235;
    }
    t["dtype"] = format == RandomWeightFormat::kF32 ? "float32" : "bfloat16";
  }
  c.erase("quantization_config");
  if (format == RandomWeightFormat::kMxfp4) c["quantization_config"] = mxfp4_quantization_config();
}

json generation_config(const json& c) {
  return {{"bos_token_id", c.value("bos_token_id", json())},
          {"eos_token_id", c.value("eos_token_id", json())},
          {"pad_token_id", c.value("pad_token_id", json())}};
}

ArchTable random_table(const json& config, const std::string& where) {
  KimiK3Config c = parse_kimi_k3_config(config, where);
  ArchTable t = kimi_k3_table(c);
  // The loader accepts any A_log of at least num_heads entries; the written one is [head_dim] wide like the real
  // [128] for 96 heads (or [num_heads] should the heads outnumber head_dim).
  const Shape a_log = {std::max(c.kda_head_dim, c.kda_heads)};
  for (auto& spec : t.specs) {
    if (spec.id == int(T::kKdaALog)) spec.shape = [a_log](int64_t) { return a_log; };
  }
  return t;
}

// Output std, for unit-RMS inputs, of each linear. Chosen so that every path of the forward matters (checked by the
// mutation tests of tests/model/kimi_k3_variants_test.cpp): SiTU gate / up pre-activations of std 3 / 8 so that both
// tanh clamps (beta 4, linear beta 25) bite; router logits spread over about +-2; q_a and the c rows of kv_a tiny
// (rms ~3e-3, see kv_a_rows) so the eps 1e-6 of q_a/kv_a_layernorm decides the result; logits of std about 3.
double linear_gain(T id) {
  switch (id) {
    case T::kMlaQA: return 0.003;
    case T::kKdaB: return 1.5;
    case T::kKdaG:
    case T::kMlaG: return 1.25;
    case T::kMlpGate:
    case T::kSharedGate:
    case T::kExpertW1: return 3.0;
    case T::kMlpUp:
    case T::kSharedUp:
    case T::kExpertW3: return 8.0;
    case T::kMlpDown:
    case T::kSharedDown:
    case T::kExpertW2: return 0.3;
    case T::kRouterGate: return 2.0;
    case T::kLmHead: return 3.0;
    default: return 1.0;
  }
}

bool is_routed_expert(T id) { return id == T::kExpertW1 || id == T::kExpertW2 || id == T::kExpertW3; }

// Tensors the real checkpoint keeps F32 (KDA conv / A_log / dt_bias / o_norm, the router bias) in every format.
bool kept_f32(T id) {
  return id == T::kKdaQConv || id == T::kKdaKConv || id == T::kKdaVConv || id == T::kKdaALog || id == T::kKdaDtBias ||
         id == T::kKdaONorm || id == T::kRouterBias;
}

void plan_vector(const KimiK3Config& c, T id, TensorPlan& p) {
  const double H = static_cast<double>(c.hidden_size);
  switch (id) {
    case T::kEmbed: p.std = 1.0; return;
    case T::kAttnResProj:
    case T::kMlpResProj:
    case T::kOutResProj: p.std = 1.5 / std::sqrt(H); return;  // AttnRes scores of std ~1.5: far from uniform mixes
    case T::kKdaQConv:
    case T::kKdaKConv:
    case T::kKdaVConv: p.std = 0.6; return;
    case T::kKdaALog: {  // exp(A_log) over about [0.5, 11]; the tail beyond num_heads is zero, as in the real one
      p.mean = 1.0;
      p.std = 0.8;
      const int64_t heads = c.kda_heads;
      p.adjust = [heads](std::span<float> v, int64_t first) {
        for (size_t i = 0; i < v.size(); ++i) {
          if (first + static_cast<int64_t>(i) >= heads) v[i] = 0.0f;
        }
      };
      return;
    }
    case T::kKdaDtBias:  // with exp(A_log): gate arguments from far negative (no decay) to positive (near the bound)
      p.mean = -1.0;
      p.std = 1.0;
      return;
    case T::kRouterBias: p.std = 0.1; return;
    case T::kFinalNorm:
    case T::kOutResNorm:
    case T::kInputNorm:
    case T::kPostAttnNorm:
    case T::kAttnResNorm:
    case T::kMlpResNorm:
    case T::kKdaONorm:
    case T::kMlaQANorm:
    case T::kMlaKvANorm:
    case T::kLatentNorm:
      p.mean = 1.0;
      p.std = 0.1;
      return;
    default: fail("kimi_k3 make-random: no init rule for tensor '{}'", int(id));
  }
}

TensorPlan plan_tensor(const KimiK3Config& c, const TensorSpec& spec, const Shape& shape, RandomWeightFormat format) {
  const T id = static_cast<T>(spec.id);
  TensorPlan p;
  p.dtype = format == RandomWeightFormat::kF32 || kept_f32(id) ? DType::kF32 : DType::kBF16;
  if (spec.kind == TensorKind::kTensor) {
    plan_vector(c, id, p);
    return p;
  }
  p.std = linear_gain(id) / std::sqrt(static_cast<double>(shape.at(1)));
  if (id == T::kMlaKvA) {  // rows [c (kv_lora) | k_pe (rope)]: c tiny like q_a, k_pe at full scale
    const int64_t c_values = c.kv_lora_rank * shape.at(1);
    p.adjust = [c_values](std::span<float> v, int64_t first) {
      for (size_t i = 0; i < v.size(); ++i) {
        if (first + static_cast<int64_t>(i) < c_values) v[i] *= 0.003f;
      }
    };
  }
  if (format == RandomWeightFormat::kMxfp4 && is_routed_expert(id)) {
    p.format = WeightFormat::kMxfp4;
    p.mxfp4_packed = true;  // compressed-tensors mxfp4-pack-quantized: .weight_packed + .weight_scale
  }
  return p;
}

}  // namespace

RandomArch kimi_k3_random_arch() {
  RandomArch a;
  a.name = "kimi_k3";
  for (const auto& p : presets()) a.presets.emplace_back(p.name);
  a.preset_config = preset_config;
  a.finalize_config = finalize_config;
  a.table = random_table;
  a.policy = [](const TensorSpec&, const Shape&, RandomWeightFormat) -> TensorPlan {
    fail("kimi_k3 make-random: the policy needs the config (config_policy)");
  };
  a.config_policy = [](const json& config, const std::string& where) -> RandomTensorPolicy {
    KimiK3Config c = parse_kimi_k3_config(config, where);
    return [c](const TensorSpec& spec, const Shape& shape, RandomWeightFormat format) {
      return plan_tensor(c, spec, shape, format);
    };
  };
  a.generation_config = generation_config;
  a.formats = {RandomWeightFormat::kMxfp4, RandomWeightFormat::kBF16, RandomWeightFormat::kF32};
  return a;
}

}  // namespace bg

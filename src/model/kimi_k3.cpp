// Kimi-K3 forward on the CPU reference ops, top to bottom: KDA and MLA layers, dense / latent-MoE FFNs with SiTU, and
// Attention Residuals (banked raw layer inputs, a running partial sum, softmax mixes). Activations fp32 [n, dim].
#include "model/kimi_k3.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "formats/checkpoint.h"
#include "kv/kda_state_pool.h"
#include "model/mla_block.h"
#include "moe/routed_experts.h"
#include "ops/attn_res/attn_res.h"
#include "ops/gated_rmsnorm/gated_rmsnorm.h"
#include "ops/kda/kda.h"
#include "ops/kda_gate/kda_gate.h"
#include "ops/linear/linear.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/router/router.h"
#include "ops/short_conv/short_conv.h"
#include "ops/situ/situ.h"

namespace bg {
namespace {

using T = K3Tensor;
using Vec = std::vector<float>;

// One KDA layer's small tensors as fp32.
struct KdaLayerWeights {
  Vec q_conv, k_conv, v_conv;  // [P, W]
  Vec a_log, dt_bias, o_norm;  // [>= heads], [P], [head_dim]
};

// Per-layer vectors every layer has.
struct LayerVectors {
  Vec input_norm, post_norm, attn_res_norm, attn_res_proj, mlp_res_norm, mlp_res_proj;
  Vec router_bias, latent_norm;  // MoE layers
};

class KimiK3Model final : public Model {
 public:
  KimiK3Model(KimiK3Config config, ModelWeights weights, const LoadOptions& options);
  const ModelInfo& info() const override { return info_; }
  std::unique_ptr<Sequence> new_sequence() override { return std::make_unique<Sequence>(&kv_pool_, &kda_pool_); }
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) override;

 private:
  void kda(int64_t layer, Sequence& seq, const float* x, int64_t n, float* out);
  void ffn(int64_t layer, const float* x, int64_t n, float* out);
  void situ_mlp(const QuantWeight& gate, const QuantWeight& up, const QuantWeight& down, const float* x, int64_t n,
                float* out);
  void latent_moe(int64_t layer, const float* x, int64_t n, float* out);
  // out = Mix(candidates; norm, proj) over [n, H] candidates.
  void mix(const std::vector<const float*>& candidates, const Vec& norm, const Vec& proj, int64_t n, float* out);

  KimiK3Config c_;
  ModelWeights w_;
  ModelInfo info_;
  std::vector<int64_t> sub_index_;  // layer -> index among MLA layers or among KDA layers
  MlaDims mla_dims_;
  std::vector<MlaLayerWeights> mla_;  // by MLA index
  std::vector<KdaLayerWeights> kda_;  // by KDA index
  std::vector<LayerVectors> vec_;     // by layer
  Vec final_norm_, out_res_norm_, out_res_proj_;
  QuantWeight lm_head_;
  MlaKvPool kv_pool_;
  KdaStatePool kda_pool_;
};

int64_t count_mla(const KimiK3Config& c) {
  return std::count(c.layer_kinds.begin(), c.layer_kinds.end(), K3LayerKind::kMla);
}

int64_t kv_blocks_for(const KimiK3Config& c, const LoadOptions& o) {
  int64_t tokens = o.max_total_tokens > 0 ? o.max_total_tokens : o.max_sequences * c.max_position_embeddings;
  return (tokens + o.kv_block_size - 1) / o.kv_block_size;
}

KimiK3Model::KimiK3Model(KimiK3Config config, ModelWeights weights, const LoadOptions& options)
    : c_(std::move(config)),
      w_(std::move(weights)),
      kv_pool_(count_mla(c_), c_.kv_cache_dim(), options.kv_block_size, kv_blocks_for(c_, options)),
      kda_pool_({c_.n_layers - count_mla(c_), c_.kda_heads, c_.kda_head_dim, c_.kda_proj_dim(), c_.conv_kernel},
                options.max_sequences) {
  info_ = {"kimi_k3", c_.vocab_size, c_.hidden_size, c_.n_layers, c_.max_position_embeddings, c_.bos_token_id,
           c_.eos_token_id};
  // Scores are (q_nope . k_nope + q_pe . k_pe) / sqrt(nope + pe); nothing is rotated.
  mla_dims_ = {c_.n_heads, c_.q_lora_rank, c_.kv_lora_rank, c_.qk_nope_head_dim, c_.qk_rope_head_dim, c_.v_head_dim,
               static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.qk_head_dim()))), nullptr, false};
  int64_t n_mla = 0, n_kda = 0;
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    LayerVectors v;
    v.input_norm = w_.tensor_f32(int(T::kInputNorm), l);
    v.post_norm = w_.tensor_f32(int(T::kPostAttnNorm), l);
    v.attn_res_norm = w_.tensor_f32(int(T::kAttnResNorm), l);
    v.attn_res_proj = w_.tensor_f32(int(T::kAttnResProj), l);
    v.mlp_res_norm = w_.tensor_f32(int(T::kMlpResNorm), l);
    v.mlp_res_proj = w_.tensor_f32(int(T::kMlpResProj), l);
    if (c_.is_moe_layer(l)) {
      v.router_bias = w_.tensor_f32(int(T::kRouterBias), l);
      if (c_.latent_norm) v.latent_norm = w_.tensor_f32(int(T::kLatentNorm), l);
    }
    vec_.push_back(std::move(v));
    if (c_.is_mla(l)) {
      sub_index_.push_back(n_mla++);
      MlaLayerWeights m;
      if (c_.q_lora_rank > 0) {
        m.q_a = &w_.linear(int(T::kMlaQA), l);
        m.q_b = &w_.linear(int(T::kMlaQB), l);
        m.q_a_norm = w_.tensor_f32(int(T::kMlaQANorm), l);
      } else {
        m.q = &w_.linear(int(T::kMlaQ), l);
      }
      m.kv_a = &w_.linear(int(T::kMlaKvA), l);
      m.kv_a_norm = w_.tensor_f32(int(T::kMlaKvANorm), l);
      m.o = &w_.linear(int(T::kMlaO), l);
      if (c_.mla_output_gate) m.gate = &w_.linear(int(T::kMlaG), l);
      m.set_kv_b(w_.linear(int(T::kMlaKvB), l), mla_dims_);
      mla_.push_back(std::move(m));
      continue;
    }
    sub_index_.push_back(n_kda++);
    KdaLayerWeights k;
    k.q_conv = w_.tensor_f32(int(T::kKdaQConv), l);
    k.k_conv = w_.tensor_f32(int(T::kKdaKConv), l);
    k.v_conv = w_.tensor_f32(int(T::kKdaVConv), l);
    const TensorView& a_log = w_.tensor(int(T::kKdaALog), l);
    BG_CHECK(a_log.rank() == 1 && a_log.dim(0) >= c_.kda_heads, "tensor '{}' in {}: shape {} but at least [{}] "
             "(one per KDA head) is needed", a_log.name, w_.checkpoint().file_of(a_log.name), shape_str(a_log.shape),
             c_.kda_heads);
    k.a_log = a_log.to_f32();
    k.a_log.resize(static_cast<size_t>(c_.kda_heads));  // the stored tail beyond num_heads is padding
    k.dt_bias = w_.tensor_f32(int(T::kKdaDtBias), l);
    k.o_norm = w_.tensor_f32(int(T::kKdaONorm), l);
    kda_.push_back(std::move(k));
  }
  final_norm_ = w_.tensor_f32(int(T::kFinalNorm));
  out_res_norm_ = w_.tensor_f32(int(T::kOutResNorm));
  out_res_proj_ = w_.tensor_f32(int(T::kOutResProj));
  if (c_.tie_word_embeddings) {
    lm_head_ = QuantWeight{WeightFormat::kDense, c_.vocab_size, c_.hidden_size, w_.tensor(int(T::kEmbed)), {},
                           "lm_head (tied)"};
  } else {
    lm_head_ = w_.linear(int(T::kLmHead));
  }
}

void KimiK3Model::forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) {
  const int64_t n = static_cast<int64_t>(tokens.size()), H = c_.hidden_size;
  if (n == 0) return;
  const int64_t start = seq.n_past();
  BG_CHECK(start + n <= c_.max_position_embeddings, "context of {} tokens exceeds max_position_embeddings {}",
           start + n, c_.max_position_embeddings);
  std::vector<int64_t> positions(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) positions[static_cast<size_t>(t)] = start + t;
  seq.reserve_kv(start + n);

  const size_t sz = static_cast<size_t>(n * H);
  std::vector<Vec> banked;         // raw inputs of layers 0, B, 2B, ...: each [n, H]
  Vec partial(sz), h(sz), x(sz), y(sz);  // partial: the running sum of the current block [n, H]
  bool partial_empty = false;
  ops::embedding_cpu(w_.tensor(int(T::kEmbed)), tokens.data(), n, partial.data());
  if (tap) (*tap)("embed", 0, partial.data(), n, H);
  auto candidates = [&] {
    std::vector<const float*> v;
    for (const Vec& b : banked) v.push_back(b.data());
    if (!partial_empty) v.push_back(partial.data());
    return v;
  };
  const float eps = static_cast<float>(c_.rms_norm_eps);
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    const LayerVectors& v = vec_[static_cast<size_t>(l)];
    if (banked.empty()) {
      h = partial;
    } else {
      mix(candidates(), v.attn_res_norm, v.attn_res_proj, n, h.data());
    }
    if (l % c_.attn_res_block_size == 0) {
      banked.push_back(partial);  // bank the RAW input of this block
      partial_empty = true;
    }
    ops::rmsnorm_cpu({n, H, eps}, h.data(), v.input_norm.data(), x.data());
    if (c_.is_mla(l)) {
      mla_block_forward(mla_dims_, mla_[static_cast<size_t>(sub_index_[static_cast<size_t>(l)])], seq,
                        sub_index_[static_cast<size_t>(l)], x.data(), positions, y.data());
    } else {
      kda(l, seq, x.data(), n, y.data());
    }
    if (partial_empty) {
      partial = y;
      partial_empty = false;
    } else {
      for (size_t i = 0; i < sz; ++i) partial[i] += y[i];
    }
    mix(candidates(), v.mlp_res_norm, v.mlp_res_proj, n, h.data());
    ops::rmsnorm_cpu({n, H, eps}, h.data(), v.post_norm.data(), x.data());
    ffn(l, x.data(), n, y.data());
    for (size_t i = 0; i < sz; ++i) partial[i] += y[i];
    if (tap) (*tap)("layer", l + 1, partial.data(), n, H);
  }
  mix(candidates(), out_res_norm_, out_res_proj_, n, h.data());
  if (tap) (*tap)("attnres_out", c_.n_layers, h.data(), n, H);
  ops::rmsnorm_cpu({n, H, eps}, h.data(), final_norm_.data(), x.data());
  if (tap) (*tap)("final_norm", c_.n_layers, x.data(), n, H);
  ops::linear_cpu(lm_head_, x.data(), n, logits);  // [n, vocab]
  seq.advance(n);
}

void KimiK3Model::mix(const std::vector<const float*>& candidates, const Vec& norm, const Vec& proj, int64_t n,
                      float* out) {
  ops::AttnResParams p{static_cast<int64_t>(candidates.size()), n, c_.hidden_size,
                       static_cast<float>(c_.rms_norm_eps)};
  ops::attn_res_mix_cpu(p, candidates.data(), norm.data(), proj.data(), out);
}

void KimiK3Model::kda(int64_t layer, Sequence& seq, const float* x, int64_t n, float* out) {
  const int64_t P = c_.kda_proj_dim(), nh = c_.kda_heads, K = c_.kda_head_dim, W = c_.conv_kernel;
  const int64_t idx = sub_index_[static_cast<size_t>(layer)];
  const KdaLayerWeights& kw = kda_[static_cast<size_t>(idx)];
  const size_t sz = static_cast<size_t>(n * P);
  // Projections, then causal short conv + SiLU with the sequence's conv state: each [n, P] = [n, nh, K].
  Vec raw(sz), q(sz), k(sz), v(sz);
  float* conv_state = kda_pool_.conv(seq.kda_slot(), idx);  // [3, P, W - 1]
  const int64_t state_floats = P * (W - 1);
  ops::ShortConvParams cp{n, P, W};
  ops::linear_cpu(w_.linear(int(T::kKdaQ), layer), x, n, raw.data());
  ops::short_conv_cpu(cp, raw.data(), kw.q_conv.data(), conv_state, q.data());
  ops::linear_cpu(w_.linear(int(T::kKdaK), layer), x, n, raw.data());
  ops::short_conv_cpu(cp, raw.data(), kw.k_conv.data(), conv_state + state_floats, k.data());
  ops::linear_cpu(w_.linear(int(T::kKdaV), layer), x, n, raw.data());
  ops::short_conv_cpu(cp, raw.data(), kw.v_conv.data(), conv_state + 2 * state_floats, v.data());
  // Per-head L2 norm (eps inside the sqrt), q scaled by K^-0.5.
  ops::kda_l2norm_cpu({n * nh, K, static_cast<float>(1.0 / std::sqrt(static_cast<double>(K))), 1e-6f}, q.data(),
                      q.data());
  ops::kda_l2norm_cpu({n * nh, K, 1.0f, 1e-6f}, k.data(), k.data());
  // Forget gate g = lb * sigmoid(exp(A_log[h]) * (f_b(f_a x) + dt_bias)) [n, nh, K]; beta = sigmoid(b_proj x) [n, nh].
  Vec fa(static_cast<size_t>(n * K)), g(sz), beta(static_cast<size_t>(n * nh));
  ops::linear_cpu(w_.linear(int(T::kKdaFA), layer), x, n, fa.data());
  ops::linear_cpu(w_.linear(int(T::kKdaFB), layer), fa.data(), n, raw.data());
  ops::kda_gate_cpu({n, nh, K, static_cast<float>(c_.gate_lower_bound)}, raw.data(), kw.a_log.data(),
                    kw.dt_bias.data(), g.data());
  ops::linear_cpu(w_.linear(int(T::kKdaB), layer), x, n, beta.data());
  ops::kda_beta_cpu(n * nh, beta.data(), beta.data());
  // Gated delta rule: recurrent for one token (decode), chunked for prefill; both continue the same state.
  Vec o(sz);
  ops::KdaParams kp{n, nh, K, K};
  float* state = kda_pool_.recurrent(seq.kda_slot(), idx);  // [nh, K, K]
  if (n == 1) {
    ops::kda_recurrent_cpu(kp, q.data(), k.data(), v.data(), g.data(), beta.data(), state, o.data());
  } else {
    ops::kda_chunked_cpu(kp, q.data(), k.data(), v.data(), g.data(), beta.data(), state, o.data());
  }
  // Output: per-head RMSNorm x sigmoid(g_proj x), then o_proj.
  ops::linear_cpu(w_.linear(int(T::kKdaG), layer), x, n, raw.data());
  ops::gated_rmsnorm_cpu({n, nh, K, static_cast<float>(c_.rms_norm_eps)}, o.data(), raw.data(), kw.o_norm.data(),
                         o.data());
  ops::linear_cpu(w_.linear(int(T::kKdaO), layer), o.data(), n, out);
}

void KimiK3Model::situ_mlp(const QuantWeight& gate, const QuantWeight& up, const QuantWeight& down, const float* x,
                           int64_t n, float* out) {
  Vec g(static_cast<size_t>(n * gate.n_out)), u(g.size());  // [n, inter]
  ops::linear_cpu(gate, x, n, g.data());
  ops::linear_cpu(up, x, n, u.data());
  ops::situ_cpu({n, gate.n_out, static_cast<float>(c_.situ_beta), static_cast<float>(c_.situ_linear_beta)}, g.data(),
                u.data(), g.data());
  ops::linear_cpu(down, g.data(), n, out);
}

void KimiK3Model::ffn(int64_t layer, const float* x, int64_t n, float* out) {
  if (c_.is_moe_layer(layer)) {
    latent_moe(layer, x, n, out);
    return;
  }
  situ_mlp(w_.linear(int(T::kMlpGate), layer), w_.linear(int(T::kMlpUp), layer), w_.linear(int(T::kMlpDown), layer), x,
           n, out);
}

void KimiK3Model::latent_moe(int64_t layer, const float* x, int64_t n, float* out) {
  const int64_t H = c_.hidden_size, E = c_.n_experts, k = c_.n_experts_per_token, D = c_.latent_size;
  const LayerVectors& v = vec_[static_cast<size_t>(layer)];
  // Route on the full hidden vector in fp32: [n, E] -> top-k [n, k].
  Vec router_logits(static_cast<size_t>(n * E));
  ops::linear_cpu(w_.linear(int(T::kRouterGate), layer), x, n, router_logits.data());
  std::vector<int32_t> ids(static_cast<size_t>(n * k));
  Vec weights(ids.size());
  ops::RouterParams rp{n, E, k, c_.n_group, c_.topk_group, c_.renormalize,
                       static_cast<float>(c_.routed_scaling_factor)};
  ops::route_topk_cpu(rp, router_logits.data(), v.router_bias.data(), ids.data(), weights.data());
  // Routed path in the latent: z = down(x) [n, D]; y = sum_i w_i E_i(z) [n, D]; y = norm(y); up(y) [n, H].
  Vec z(static_cast<size_t>(n * D)), y(z.size(), 0.0f);
  ops::linear_cpu(w_.linear(int(T::kLatentDown), layer), x, n, z.data());
  ExpertDispatch dispatch = group_by_expert(ids.data(), weights.data(), n, k, E);
  run_routed_experts_loopback(dispatch, z.data(), n, D, D, [&](int64_t e, const float* in, int64_t rows, float* eo) {
    situ_mlp(w_.linear(int(T::kExpertW1), layer, e), w_.linear(int(T::kExpertW3), layer, e),
             w_.linear(int(T::kExpertW2), layer, e), in, rows, eo);
  }, y.data());
  if (c_.latent_norm) {
    ops::rmsnorm_cpu({n, D, static_cast<float>(c_.rms_norm_eps)}, y.data(), v.latent_norm.data(), y.data());
  }
  ops::linear_cpu(w_.linear(int(T::kLatentUp), layer), y.data(), n, out);
  // Shared experts at full width on the un-projected x.
  if (c_.n_shared_experts > 0) {
    Vec s(static_cast<size_t>(n * H));
    situ_mlp(w_.linear(int(T::kSharedGate), layer), w_.linear(int(T::kSharedUp), layer),
             w_.linear(int(T::kSharedDown), layer), x, n, s.data());
    for (size_t i = 0; i < s.size(); ++i) out[i] += s[i];
  }
}

}  // namespace

std::unique_ptr<Model> load_kimi_k3(const std::filesystem::path& dir, const KimiK3Config& config,
                                    const LoadOptions& options) {
  std::shared_ptr<const Checkpoint> ckpt = Checkpoint::open(dir);
  ModelWeights weights = ModelWeights::bind(ckpt, kimi_k3_table(config));
  log::info("loaded kimi_k3 checkpoint {}: {} layers ({} MLA), {} experts top-{}, hidden {}", dir.string(),
            config.n_layers, count_mla(config), config.n_experts, config.n_experts_per_token, config.hidden_size);
  return std::make_unique<KimiK3Model>(config, std::move(weights), options);
}

}  // namespace bg

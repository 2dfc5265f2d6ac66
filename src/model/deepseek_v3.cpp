// DeepSeek-V3 / Kimi-K2 forward on the CPU reference ops, top to bottom. Activations are fp32 [n_tokens, dim].
#include "model/deepseek_v3.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "formats/checkpoint.h"
#include "moe/routed_experts.h"
#include "ops/linear/linear.h"
#include "ops/mla/mla.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/rope/rope.h"
#include "ops/router/router.h"
#include "ops/swiglu/swiglu.h"

namespace bg {
namespace {

using T = DsTensor;
using Vec = std::vector<float>;

// transformers builds q_a_layernorm / kv_a_layernorm without an eps argument: they use 1e-6, not rms_norm_eps.
constexpr float kLatentNormEps = 1e-6f;

// Per-layer MLA weights prepared once at load: kv_b_proj split per head into W_UK [nh, nope, kv_lora] and
// W_UV [nh, v, kv_lora]; norm weights as fp32.
struct MlaLayerCache {
  Vec w_uk, w_uv, q_a_norm, kv_a_norm;
};

class DeepseekV3Model final : public Model {
 public:
  DeepseekV3Model(DeepseekV3Config config, ModelWeights weights, const LoadOptions& options);
  const ModelInfo& info() const override { return info_; }
  std::unique_ptr<Sequence> new_sequence() override { return std::make_unique<Sequence>(&kv_pool_, nullptr); }
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) override;

 private:
  void attention(int64_t layer, Sequence& seq, const Vec& x, const std::vector<int64_t>& positions, Vec& out);
  void dense_mlp(int64_t layer, const Vec& x, int64_t n, Vec& out);
  void moe(int64_t layer, const Vec& x, int64_t n, Vec& out);
  void swiglu_ffn(const QuantWeight& gate, const QuantWeight& up, const QuantWeight& down, const float* x, int64_t n,
                  float* out);

  DeepseekV3Config c_;
  ModelWeights w_;
  ModelInfo info_;
  ops::RopeTable rope_;
  float softmax_scale_ = 0.0f;
  std::vector<MlaLayerCache> mla_;
  std::vector<Vec> input_norm_, post_norm_, router_bias_;
  Vec final_norm_;
  QuantWeight lm_head_;
  MlaKvPool kv_pool_;
};

DeepseekV3Model::DeepseekV3Model(DeepseekV3Config config, ModelWeights weights, const LoadOptions& options)
    : c_(std::move(config)),
      w_(std::move(weights)),
      kv_pool_(c_.n_layers, c_.kv_cache_dim(), options.kv_block_size,
               options.max_total_tokens > 0
                   ? (options.max_total_tokens + options.kv_block_size - 1) / options.kv_block_size
                   : options.max_sequences * ((c_.max_position_embeddings + options.kv_block_size - 1) /
                                              options.kv_block_size)) {
  info_ = {"deepseek_v3", c_.vocab_size, c_.hidden_size, c_.n_layers, c_.max_position_embeddings, c_.bos_token_id,
           c_.eos_token_id};
  if (c_.qk_rope_head_dim > 0) rope_ = ops::compute_rope_table(c_.rope, c_.qk_rope_head_dim, c_.max_position_embeddings);
  softmax_scale_ = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.qk_head_dim())) *
                                      ops::yarn_softmax_scale_multiplier(c_.rope));
  const int64_t nh = c_.n_heads, nope = c_.qk_nope_head_dim, vd = c_.v_head_dim, r = c_.kv_lora_rank;
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    MlaLayerCache m;
    Vec kv_b = w_.linear(int(T::kKvBProj), l).decode_all();  // [nh * (nope + v), kv_lora]
    m.w_uk.resize(static_cast<size_t>(nh * nope * r));
    m.w_uv.resize(static_cast<size_t>(nh * vd * r));
    for (int64_t h = 0; h < nh; ++h) {
      const float* head = kv_b.data() + h * (nope + vd) * r;
      std::copy(head, head + nope * r, m.w_uk.begin() + h * nope * r);
      std::copy(head + nope * r, head + (nope + vd) * r, m.w_uv.begin() + h * vd * r);
    }
    if (c_.q_lora_rank > 0) m.q_a_norm = w_.tensor_f32(int(T::kQANorm), l);
    m.kv_a_norm = w_.tensor_f32(int(T::kKvANorm), l);
    mla_.push_back(std::move(m));
    input_norm_.push_back(w_.tensor_f32(int(T::kInputNorm), l));
    post_norm_.push_back(w_.tensor_f32(int(T::kPostAttnNorm), l));
    router_bias_.push_back(c_.is_moe_layer(l) ? w_.tensor_f32(int(T::kRouterBias), l) : Vec{});
  }
  final_norm_ = w_.tensor_f32(int(T::kFinalNorm));
  if (c_.tie_word_embeddings) {
    const TensorView& embed = w_.tensor(int(T::kEmbed));
    lm_head_ = QuantWeight{WeightFormat::kDense, c_.vocab_size, c_.hidden_size, embed, {}, "lm_head (tied)"};
  } else {
    lm_head_ = w_.linear(int(T::kLmHead));
  }
}

void DeepseekV3Model::forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) {
  const int64_t n = static_cast<int64_t>(tokens.size()), H = c_.hidden_size;
  if (n == 0) return;
  const int64_t start = seq.n_past();
  BG_CHECK(start + n <= c_.max_position_embeddings, "context of {} tokens exceeds max_position_embeddings {}",
           start + n, c_.max_position_embeddings);
  std::vector<int64_t> positions(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) positions[static_cast<size_t>(t)] = start + t;
  seq.reserve_kv(start + n);

  Vec h(static_cast<size_t>(n * H)), x(h.size()), y(h.size());  // [n, H]
  ops::embedding_cpu(w_.tensor(int(T::kEmbed)), tokens.data(), n, h.data());
  if (tap) (*tap)("embed", 0, h.data(), n, H);
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    ops::rmsnorm_cpu({n, H, static_cast<float>(c_.rms_norm_eps)}, h.data(), input_norm_[static_cast<size_t>(l)].data(),
                     x.data());
    attention(l, seq, x, positions, y);
    for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
    ops::rmsnorm_cpu({n, H, static_cast<float>(c_.rms_norm_eps)}, h.data(), post_norm_[static_cast<size_t>(l)].data(),
                     x.data());
    if (c_.is_moe_layer(l)) {
      moe(l, x, n, y);
    } else {
      dense_mlp(l, x, n, y);
    }
    for (size_t i = 0; i < h.size(); ++i) h[i] += y[i];
    if (tap) (*tap)("layer", l + 1, h.data(), n, H);
  }
  ops::rmsnorm_cpu({n, H, static_cast<float>(c_.rms_norm_eps)}, h.data(), final_norm_.data(), x.data());
  if (tap) (*tap)("final_norm", c_.n_layers, x.data(), n, H);
  ops::linear_cpu(lm_head_, x.data(), n, logits);  // [n, vocab]
  seq.advance(n);
}

void DeepseekV3Model::attention(int64_t layer, Sequence& seq, const Vec& x, const std::vector<int64_t>& positions,
                                Vec& out) {
  const int64_t n = static_cast<int64_t>(positions.size()), nh = c_.n_heads;
  const int64_t qk = c_.qk_head_dim(), r = c_.kv_lora_rank, rope = c_.qk_rope_head_dim, entry = c_.kv_cache_dim();
  const MlaLayerCache& m = mla_[static_cast<size_t>(layer)];
  // Query: [n, nh, nope + rope]
  Vec q(static_cast<size_t>(n * nh * qk));
  if (c_.q_lora_rank > 0) {
    Vec cq(static_cast<size_t>(n * c_.q_lora_rank));  // [n, q_lora]
    ops::linear_cpu(w_.linear(int(T::kQAProj), layer), x.data(), n, cq.data());
    ops::rmsnorm_cpu({n, c_.q_lora_rank, kLatentNormEps}, cq.data(), m.q_a_norm.data(), cq.data());
    ops::linear_cpu(w_.linear(int(T::kQBProj), layer), cq.data(), n, q.data());
  } else {
    ops::linear_cpu(w_.linear(int(T::kQProj), layer), x.data(), n, q.data());
  }
  // Latent: [n, kv_lora + rope] = [c_kv | k_pe]; c_kv normed, k_pe rotated; written to the cache.
  Vec kv(static_cast<size_t>(n * entry));
  ops::linear_cpu(w_.linear(int(T::kKvAProj), layer), x.data(), n, kv.data());
  for (int64_t t = 0; t < n; ++t) {
    ops::rmsnorm_cpu({1, r, kLatentNormEps}, kv.data() + t * entry, m.kv_a_norm.data(), kv.data() + t * entry);
  }
  if (rope > 0) {
    ops::apply_rope_cpu({n, nh, qk, nh * qk, c_.qk_nope_head_dim, rope, c_.rope_interleave}, rope_, positions.data(),
                        q.data());
    ops::apply_rope_cpu({n, 1, entry, entry, r, rope, c_.rope_interleave}, rope_, positions.data(), kv.data());
  }
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(kv.data() + t * entry, entry, seq.kv_entry(layer, positions[static_cast<size_t>(t)]));
  }
  auto blocks = seq.kv_block_ptrs(layer);
  Vec attn(static_cast<size_t>(n * nh * c_.v_head_dim));  // [n, nh, v]
  ops::MlaParams p{n, nh, r, c_.qk_nope_head_dim, rope, c_.v_head_dim, kv_pool_.block_size(), softmax_scale_};
  ops::mla_attention_cpu(p, q.data(), m.w_uk.data(), m.w_uv.data(), blocks.data(), positions.data(), attn.data());
  ops::linear_cpu(w_.linear(int(T::kOProj), layer), attn.data(), n, out.data());
}

void DeepseekV3Model::swiglu_ffn(const QuantWeight& gate, const QuantWeight& up, const QuantWeight& down,
                                 const float* x, int64_t n, float* out) {
  Vec g(static_cast<size_t>(n * gate.n_out)), u(g.size());  // [n, inter]
  ops::linear_cpu(gate, x, n, g.data());
  ops::linear_cpu(up, x, n, u.data());
  ops::swiglu_cpu(g.data(), u.data(), static_cast<int64_t>(g.size()), g.data());
  ops::linear_cpu(down, g.data(), n, out);
}

void DeepseekV3Model::dense_mlp(int64_t layer, const Vec& x, int64_t n, Vec& out) {
  swiglu_ffn(w_.linear(int(T::kMlpGate), layer), w_.linear(int(T::kMlpUp), layer), w_.linear(int(T::kMlpDown), layer),
             x.data(), n, out.data());
}

void DeepseekV3Model::moe(int64_t layer, const Vec& x, int64_t n, Vec& out) {
  const int64_t H = c_.hidden_size, E = c_.n_routed_experts, k = c_.n_experts_per_tok;
  // Route: fp32 logits [n, E] -> top-k ids/weights [n, k].
  Vec router_logits(static_cast<size_t>(n * E));
  ops::linear_cpu(w_.linear(int(T::kRouterGate), layer), x.data(), n, router_logits.data());
  std::vector<int32_t> ids(static_cast<size_t>(n * k));
  Vec weights(ids.size());
  ops::RouterParams rp{n, E, k, c_.n_group, c_.topk_group, c_.norm_topk_prob,
                       static_cast<float>(c_.routed_scaling_factor)};
  ops::route_topk_cpu(rp, router_logits.data(), router_bias_[static_cast<size_t>(layer)].data(), ids.data(),
                      weights.data());
  // Shared experts on every token, then routed experts accumulated on top.
  if (c_.n_shared_experts > 0) {
    swiglu_ffn(w_.linear(int(T::kSharedGate), layer), w_.linear(int(T::kSharedUp), layer),
               w_.linear(int(T::kSharedDown), layer), x.data(), n, out.data());
  } else {
    std::fill(out.begin(), out.end(), 0.0f);
  }
  ExpertDispatch dispatch = group_by_expert(ids.data(), weights.data(), n, k, E);
  run_routed_experts_loopback(dispatch, x.data(), n, H, H, [&](int64_t e, const float* in, int64_t rows, float* y) {
    swiglu_ffn(w_.linear(int(T::kExpertGate), layer, e), w_.linear(int(T::kExpertUp), layer, e),
               w_.linear(int(T::kExpertDown), layer, e), in, rows, y);
  }, out.data());
}

}  // namespace

std::unique_ptr<Model> load_deepseek_v3(const std::filesystem::path& dir, const DeepseekV3Config& config,
                                        const LoadOptions& options) {
  std::shared_ptr<const Checkpoint> ckpt = Checkpoint::open(dir);
  ModelWeights weights = ModelWeights::bind(ckpt, deepseek_v3_table(config));
  log::info("loaded deepseek_v3 checkpoint {}: {} layers, {} routed experts, hidden {}", dir.string(), config.n_layers,
            config.n_routed_experts, config.hidden_size);
  return std::make_unique<DeepseekV3Model>(config, std::move(weights), options);
}

}  // namespace bg

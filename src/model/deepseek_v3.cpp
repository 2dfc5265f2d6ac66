// DeepSeek-V3 / Kimi-K2 forward on the CPU reference ops, top to bottom. Activations are fp32 [n_tokens, dim].
#include "model/deepseek_v3.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "formats/checkpoint.h"
#include "model/mla_block.h"
#include "moe/routed_experts.h"
#include "ops/linear/linear.h"
#include "ops/rmsnorm/rmsnorm.h"
#include "ops/rope/rope.h"
#include "ops/router/router.h"
#include "ops/swiglu/swiglu.h"

namespace bg {
namespace {

using T = DsTensor;
using Vec = std::vector<float>;

class DeepseekV3Model final : public Model {
 public:
  DeepseekV3Model(DeepseekV3Config config, ModelWeights weights, const LoadOptions& options);
  const ModelInfo& info() const override { return info_; }
  std::unique_ptr<Sequence> new_sequence() override { return std::make_unique<Sequence>(&kv_pool_, nullptr); }
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) override;

 private:
  void dense_mlp(int64_t layer, const Vec& x, int64_t n, Vec& out);
  void moe(int64_t layer, const Vec& x, int64_t n, Vec& out);
  void swiglu_ffn(const QuantWeight& gate, const QuantWeight& up, const QuantWeight& down, const float* x, int64_t n,
                  float* out);

  DeepseekV3Config c_;
  ModelWeights w_;
  ModelInfo info_;
  ops::RopeTable rope_;
  MlaDims mla_dims_;
  std::vector<MlaLayerWeights> mla_;
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
  float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.qk_head_dim())) *
                                   ops::yarn_softmax_scale_multiplier(c_.rope));
  mla_dims_ = {c_.n_heads, c_.q_lora_rank, c_.kv_lora_rank, c_.qk_nope_head_dim, c_.qk_rope_head_dim, c_.v_head_dim,
               scale, c_.qk_rope_head_dim > 0 ? &rope_ : nullptr, c_.rope_interleave};
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    MlaLayerWeights m;
    if (c_.q_lora_rank > 0) {
      m.q_a = &w_.linear(int(T::kQAProj), l);
      m.q_b = &w_.linear(int(T::kQBProj), l);
      m.q_a_norm = w_.tensor_f32(int(T::kQANorm), l);
    } else {
      m.q = &w_.linear(int(T::kQProj), l);
    }
    m.kv_a = &w_.linear(int(T::kKvAProj), l);
    m.kv_a_norm = w_.tensor_f32(int(T::kKvANorm), l);
    m.o = &w_.linear(int(T::kOProj), l);
    m.set_kv_b(w_.linear(int(T::kKvBProj), l), mla_dims_);
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
    mla_block_forward(mla_dims_, mla_[static_cast<size_t>(l)], seq, l, x.data(), positions, y.data());
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

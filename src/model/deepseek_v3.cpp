// DeepSeek-V3 / Kimi-K2 forward over the backend ops, top to bottom. Activations [n_tokens, dim] in the backend's
// activation dtype.
#include "model/deepseek_v3.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "formats/checkpoint.h"
#include "model/backend_weights.h"
#include "model/forward_common.h"
#include "model/mla_block.h"
#include "model/rank_share.h"
#include "model/step_model.h"
#include "moe/moe_layer.h"
#include "weights/open_source.h"

namespace bg {
namespace {

using T = DsTensor;

struct DsLayer {
  MlaLayerWeights mla;
  Tensor input_norm, post_norm;  // F32
  moe::MoeLayerWeights moe;      // MoE layers
  LinearGroup mlp_in;            // gate, up of the dense MLP or of the shared experts (BackendLinears::group)
};

// The groups of linears that read one input; BackendLinears prepares each side by side (fused at decode where the
// backend can).
const std::vector<int> kMlaInLora = {int(T::kQAProj), int(T::kKvAProj)}, kMlaIn = {int(T::kQProj), int(T::kKvAProj)};
const std::vector<int> kMlpIn = {int(T::kMlpGate), int(T::kMlpUp)};
const std::vector<int> kSharedIn = {int(T::kSharedGate), int(T::kSharedUp)};
const std::vector<std::vector<int>>& ds_linear_groups() {
  static const std::vector<std::vector<int>> groups = {kMlaInLora, kMlaIn, kMlpIn, kSharedIn};
  return groups;
}

class DeepseekV3Model final : public StepModel {
 public:
  DeepseekV3Model(DeepseekV3Config config, ModelWeights weights, std::unique_ptr<Backend> backend,
                  const LoadOptions& options);
  const ModelInfo& info() const override { return info_; }
  const StateGeometry& state_geometry() const override { return state_geometry_; }
  Backend& backend() const override { return *be_; }

 private:
  Tensor step_body(const StepPools& pools, bool all_rows, const TapFn* tap) override;
  void ffn(int64_t layer, const Tensor& x, Tensor& out);

  DeepseekV3Config c_;
  ModelWeights w_;
  std::unique_ptr<Backend> be_;
  moe::ExpertPlacement experts_at_;  // where each routed expert lives (this rank loads only its own)
  moe::ExpertResidency residency_;   // which of them stay in backend memory (the others stream)
  BackendLinears lin_;
  ModelInfo info_;
  RopeHandle rope_;
  MlaDims mla_dims_;
  moe::MoeLayerSpec moe_spec_;
  std::vector<DsLayer> layers_;
  Tensor embed_, final_norm_;
  std::unique_ptr<LinearHandle> tied_lm_head_;
  StateGeometry state_geometry_;
};

DeepseekV3Model::DeepseekV3Model(DeepseekV3Config config, ModelWeights weights, std::unique_ptr<Backend> backend,
                                 const LoadOptions& options)
    : StepModel(options),
      c_(std::move(config)),
      w_(std::move(weights)),
      be_(std::move(backend)),
      experts_at_(placement(c_.n_routed_experts)),
      residency_(plan_residency(experts_at_)),
      lin_(*be_, w_, [this](int id, int64_t layer, int64_t expert) {
               if (expert >= 0 && !residency_.resident(layer, expert)) return LinearShare{ShareKind::kSkip};
               return deepseek_v3_share(id, expert, {tp_size(), tp_rank(), &experts_at_});
             }, ds_linear_groups()),
      state_geometry_(bg::state_geometry(c_)) {
  Backend& be = *be_;
  info_ = {"deepseek_v3", c_.vocab_size, c_.hidden_size, c_.n_layers, c_.max_position_embeddings, c_.bos_token_id,
           c_.eos_token_id};
  if (c_.qk_rope_head_dim > 0) {
    rope_ = be.prepare_rope(ops::compute_rope_table(c_.rope, c_.qk_rope_head_dim, c_.max_position_embeddings));
  }
  float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.qk_head_dim())) *
                                   ops::yarn_softmax_scale_multiplier(c_.rope));
  BG_CHECK(c_.n_heads % tp_size() == 0, "--tp {} does not divide the {} attention heads", tp_size(), c_.n_heads);
  mla_dims_ = {c_.n_heads / tp_size(), c_.q_lora_rank, c_.kv_lora_rank, c_.qk_nope_head_dim, c_.qk_rope_head_dim,
               c_.v_head_dim, scale, c_.qk_rope_head_dim > 0 ? &rope_ : nullptr, c_.rope_interleave};
  init_exchange(c_.n_routed_experts, c_.n_experts_per_tok, c_.hidden_size);
  moe_spec_ = {{0, c_.n_routed_experts, c_.n_experts_per_tok, c_.n_group, c_.topk_group, c_.norm_topk_prob,
                static_cast<float>(c_.routed_scaling_factor)},
               {GluKind::kSwiGlu}};
  auto vec = [&](T id, int64_t layer) {
    std::vector<float> v = w_.tensor_f32(int(id), layer);
    return be.upload_f32(v, {static_cast<int64_t>(v.size())}, DType::kF32);
  };
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    DsLayer L;
    if (c_.q_lora_rank > 0) {
      L.mla.q_a = &lin_.get(int(T::kQAProj), l);
      L.mla.q_b = &lin_.get(int(T::kQBProj), l);
      L.mla.q_a_norm = vec(T::kQANorm, l);
    } else {
      L.mla.q = &lin_.get(int(T::kQProj), l);
    }
    L.mla.kv_a = &lin_.get(int(T::kKvAProj), l);
    L.mla.kv_a_norm = vec(T::kKvANorm, l);
    L.mla.o = &lin_.get(int(T::kOProj), l);
    L.mla.set_kv_b(be, w_.linear(int(T::kKvBProj), l), mla_dims_, tp_rank() * mla_dims_.n_heads);
    L.mla.in = lin_.group(c_.q_lora_rank > 0 ? kMlaInLora : kMlaIn, l);
    if (!c_.is_moe_layer(l)) {
      L.mlp_in = lin_.group(kMlpIn, l);
    } else if (c_.n_shared_experts > 0) {
      L.mlp_in = lin_.group(kSharedIn, l);
    }
    L.input_norm = vec(T::kInputNorm, l);
    L.post_norm = vec(T::kPostAttnNorm, l);
    if (c_.is_moe_layer(l)) {
      L.moe.router = &lin_.get(int(T::kRouterGate), l);
      L.moe.router_bias = vec(T::kRouterBias, l);
      auto source = [&](int32_t e) -> moe::ExpertSource {
        return {w_.linear(int(T::kExpertGate), l, e), w_.linear(int(T::kExpertUp), l, e),
                w_.linear(int(T::kExpertDown), l, e)};
      };
      L.moe.experts = moe::ExpertTable(be, experts_at_,
                                       lin_.experts(int(T::kExpertGate), int(T::kExpertUp), int(T::kExpertDown), l,
                                                    c_.n_routed_experts),
                                       streamed_experts(residency_, experts_at_, l, source));
    }
    layers_.push_back(std::move(L));
  }
  pin_streamed_experts();
  embed_ = be.upload_view(w_.tensor(int(T::kEmbed)));
  final_norm_ = vec(T::kFinalNorm, -1);
  if (c_.tie_word_embeddings) {
    const TensorView& e = w_.tensor(int(T::kEmbed));
    const SharedWeight head = share_linear(
        QuantWeight{WeightFormat::kDense, c_.vocab_size, c_.hidden_size, e, {}, "lm_head", {}},
        tp_share(ShareKind::kRows));
    tied_lm_head_ = be.prepare_linear(head.w);  // a row share views the embedding: nothing copied
  }
}


Tensor DeepseekV3Model::step_body(const StepPools& pools, bool all_rows, const TapFn* tap) {
  Backend& be = *be_;
  const int64_t n = be.step().n_tokens(), H = c_.hidden_size;
  Tensor h = be.act(n, H), x = be.act(n, H), y = be.act(n, H);  // [n, H]
  be.embedding(embed_, h);
  tap_tensor(*be_, tap, "embed", 0, h);
  const float eps = static_cast<float>(c_.rms_norm_eps);
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    const DsLayer& L = layers_[static_cast<size_t>(l)];
    be.rmsnorm(h, L.input_norm, eps, x);
    mla_block_forward(be, mla_dims_, L.mla, pools.kv->layer_ref(l), x, y);
    tp_all_reduce(y);  // TP: each rank's heads gave a partial o_proj sum
    tap_tensor(be, tap, "attn", l + 1, y);
    be.add(h, y);
    be.rmsnorm(h, L.post_norm, eps, x);
    ffn(l, x, y);
    tp_all_reduce(y);  // TP: partial down-projection sums (dense, shared experts) + each rank's routed rows
    tap_tensor(be, tap, "ffn", l + 1, y);
    be.add(h, y);
    tap_tensor(*be_, tap, "layer", l + 1, h);
  }
  be.rmsnorm(h, final_norm_, eps, x);
  tap_tensor(*be_, tap, "final_norm", c_.n_layers, x);
  return lm_head_logits(tied_lm_head_ ? *tied_lm_head_ : lin_.get(int(T::kLmHead)), x, all_rows);
}

void DeepseekV3Model::ffn(int64_t layer, const Tensor& x, Tensor& out) {
  Backend& be = *be_;
  const int64_t n = x.rows();
  const GluSpec swiglu{GluKind::kSwiGlu};
  DsLayer& L = layers_[static_cast<size_t>(layer)];
  auto mlp = [&](T down) {  // down(SwiGLU(gate x, up x)), gate and up from the layer's group
    const GroupProjections in(be, L.mlp_in, x);
    Tensor g = in[0];  // [n, inter]
    be.glu(swiglu, g, in[1], g);
    be.linear(lin_.get(int(down), layer), g, out);
  };
  if (!c_.is_moe_layer(layer)) {
    mlp(T::kMlpDown);
    return;
  }
  // This TP rank routes rows [r0, r0 + rn) of the step (all of them without TP). Route in fp32: logits [rn, E] ->
  // top-k ids / weights [rn, k].
  const auto [r0, rn] = moe_rows(n);
  const Tensor xs = x.rows_view(r0, rn);
  moe::MoeChoice choice = moe::moe_route(be, moe_spec_, L.moe, xs, r0);
  if (rn > 0) apply_route_hook(be, route_hook_, layer, choice.ids, choice.weights);
  // Shared experts on every token (while the routed rows are in flight; a partial sum with TP), the routed experts
  // accumulated on top of this rank's rows.
  auto run_shared = [&] {
    if (c_.n_shared_experts > 0) {
      mlp(T::kSharedDown);
    } else {
      be.fill_zero(out);
    }
  };
  Tensor routed_out = out.rows_view(r0, rn);
  moe::moe_routed(be, exchange(), moe_spec_, L.moe, choice, xs, routed_out, run_shared);
}

}  // namespace

std::unique_ptr<Model> load_deepseek_v3(const std::filesystem::path& dir, const DeepseekV3Config& config,
                                        const LoadOptions& options) {
  auto source = weights::open_weight_source(dir, {options.weight_store, options.distributed_weight_config});
  ModelWeights weights = ModelWeights::bind(source, deepseek_v3_table(config), bind_options(options));
  auto backend = make_backend(options.device,
                              {.deterministic = options.deterministic, .background_plans = options.background_plans});
  log::info("loaded deepseek_v3 checkpoint {} on {}: {} layers, {} routed experts, hidden {}", dir.string(),
            backend->name(), config.n_layers, config.n_routed_experts, config.hidden_size);
  return std::make_unique<DeepseekV3Model>(config, std::move(weights), std::move(backend), options);
}

}  // namespace bg

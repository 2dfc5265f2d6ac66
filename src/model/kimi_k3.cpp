// Kimi-K3 forward over the backend ops, top to bottom: KDA and MLA layers, dense / latent-MoE FFNs with SiTU, and
// Attention Residuals (banked raw layer inputs, a running partial sum, softmax mixes). Activations [n, dim].
#include "model/kimi_k3.h"

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
#include "model/tp_shard.h"
#include "moe/moe_layer.h"
#include "weights/open_source.h"

namespace bg {
namespace {

using T = K3Tensor;

struct K3Layer {
  Tensor input_norm, post_norm, attn_res_norm, attn_res_proj, mlp_res_norm, mlp_res_proj;  // F32 [H]
  Tensor latent_norm;                                                                    // MoE layers
  moe::MoeLayerWeights moe;
  // KDA layers
  Tensor q_conv, k_conv, v_conv;  // F32 [P, W]
  Tensor a_log, dt_bias, o_norm;  // F32 [heads], [P], [head_dim]
  int64_t sub_index = 0;          // index among MLA layers or among KDA layers
  MlaLayerWeights mla;
  // What projects a sublayer's normed input x (BackendLinears::group, fused at decode where the backend can):
  // KDA q, k, v, g, f_a, b; the FFN's gate, up (dense layers) or latent-down, shared gate, shared up (MoE layers);
  // the shared experts' gate, up alone (with TP or a remote exchange, latent-down reads other rows or must wait).
  LinearGroup kda_in, ffn_in, shared_in;
};

// The groups of linears that read one input (see K3Layer), in the order their outputs are used.
const std::vector<int> kKdaIn = {int(T::kKdaQ), int(T::kKdaK), int(T::kKdaV), int(T::kKdaG), int(T::kKdaFA),
                                 int(T::kKdaB)};
const std::vector<int> kMoeIn = {int(T::kLatentDown), int(T::kSharedGate), int(T::kSharedUp)};
const std::vector<int> kSharedIn = {int(T::kSharedGate), int(T::kSharedUp)};  // parts only: a member of kMoeIn
const std::vector<int> kMlpIn = {int(T::kMlpGate), int(T::kMlpUp)};
// MLA: q_a (or q with no q LoRA), kv_a, then the output gate where the model has one.
std::vector<int> mla_in(bool q_lora, bool gate) {
  std::vector<int> ids = {int(q_lora ? T::kMlaQA : T::kMlaQ), int(T::kMlaKvA)};
  if (gate) ids.push_back(int(T::kMlaG));
  return ids;
}

// What BackendLinears prepares side by side (the MLA variants: the one a layer has is complete, the others not).
const std::vector<std::vector<int>>& k3_linear_groups() {
  static const std::vector<std::vector<int>> groups = {
      kKdaIn, mla_in(true, true), mla_in(true, false), mla_in(false, true), mla_in(false, false), kMlpIn, kMoeIn};
  return groups;
}

class KimiK3Model final : public StepModel {
 public:
  KimiK3Model(KimiK3Config config, ModelWeights weights, std::unique_ptr<Backend> backend,
              const LoadOptions& options);
  const ModelInfo& info() const override { return info_; }
  const StateGeometry& state_geometry() const override { return state_geometry_; }
  Backend& backend() const override { return *be_; }

 private:
  Tensor step_body(const StepPools& pools, bool all_rows, const TapFn* tap) override;
  void load_layer(int64_t l, int64_t& n_mla, int64_t& n_kda);
  void kda(const KdaStatePool& state, int64_t layer, const Tensor& x, Tensor& out);
  void ffn(int64_t layer, const Tensor& x, Tensor& out);
  // down(SiTU(gate x, up x)) from the projections `first` (gate) and `first` + 1 (up) of `in`.
  void situ_mlp(const GroupProjections& in, size_t first, T down, int64_t layer, Tensor& out);
  void latent_moe(int64_t layer, const Tensor& x, Tensor& out);

  KimiK3Config c_;
  ModelWeights w_;
  std::unique_ptr<Backend> be_;
  moe::ExpertPlacement experts_at_;  // where each routed expert lives (this rank loads only its own)
  moe::ExpertResidency residency_;   // which of them stay in backend memory (the others stream)
  int64_t kda_heads_ = 0;            // KDA heads on this rank (all, or its tensor-parallel range)
  BackendLinears lin_;
  ModelInfo info_;
  MlaDims mla_dims_;
  GluSpec situ_;
  moe::MoeLayerSpec moe_spec_;
  std::vector<K3Layer> layers_;
  Tensor embed_, final_norm_, out_res_norm_, out_res_proj_;
  std::unique_ptr<LinearHandle> tied_lm_head_;
  StateGeometry state_geometry_;
};

int64_t count_mla(const KimiK3Config& c) {
  return std::count(c.layer_kinds.begin(), c.layer_kinds.end(), K3LayerKind::kMla);
}

KimiK3Model::KimiK3Model(KimiK3Config config, ModelWeights weights, std::unique_ptr<Backend> backend,
                         const LoadOptions& options)
    : StepModel(options),
      c_(std::move(config)),
      w_(std::move(weights)),
      be_(std::move(backend)),
      experts_at_(placement(c_.n_experts)),
      residency_(plan_residency(experts_at_)),
      kda_heads_(c_.kda_heads / tp_size()),
      lin_(*be_, w_, [this](int id, int64_t layer, int64_t expert) {
               if (expert >= 0 && !residency_.resident(layer, expert)) return LinearShare{ShareKind::kSkip};
               return kimi_k3_share(id, expert, {tp_size(), tp_rank(), &experts_at_});
             }, k3_linear_groups()),
      state_geometry_(tp_state_geometry(bg::state_geometry(c_), tp_size())) {
  BG_CHECK(c_.n_heads % tp_size() == 0 && c_.kda_heads % tp_size() == 0, "--tp {} does not divide the {} MLA heads "
           "and {} KDA heads", tp_size(), c_.n_heads, c_.kda_heads);
  info_ = {"kimi_k3", c_.vocab_size, c_.hidden_size, c_.n_layers, c_.max_position_embeddings, c_.bos_token_id,
           c_.eos_token_id};
  // Scores are (q_nope . k_nope + q_pe . k_pe) / sqrt(nope + pe); nothing is rotated.
  mla_dims_ = {c_.n_heads / tp_size(), c_.q_lora_rank, c_.kv_lora_rank, c_.qk_nope_head_dim, c_.qk_rope_head_dim,
               c_.v_head_dim, static_cast<float>(1.0 / std::sqrt(static_cast<double>(c_.qk_head_dim()))), nullptr,
               false};
  situ_ = {GluKind::kSitu, static_cast<float>(c_.situ_beta), static_cast<float>(c_.situ_linear_beta)};
  moe_spec_ = {{0, c_.n_experts, c_.n_experts_per_token, c_.n_group, c_.topk_group, c_.renormalize,
                static_cast<float>(c_.routed_scaling_factor)},
               situ_};
  init_exchange(c_.n_experts, c_.n_experts_per_token, c_.latent_size);  // the routed experts run in the latent
  int64_t n_mla = 0, n_kda = 0;
  for (int64_t l = 0; l < c_.n_layers; ++l) load_layer(l, n_mla, n_kda);
  pin_streamed_experts();
  auto vec = [&](T id) {
    std::vector<float> v = w_.tensor_f32(int(id));
    return be_->upload_f32(v, {static_cast<int64_t>(v.size())}, DType::kF32);
  };
  embed_ = be_->upload_view(w_.tensor(int(T::kEmbed)));
  final_norm_ = vec(T::kFinalNorm);
  out_res_norm_ = vec(T::kOutResNorm);
  out_res_proj_ = vec(T::kOutResProj);
  if (c_.tie_word_embeddings) {
    const TensorView& e = w_.tensor(int(T::kEmbed));
    const SharedWeight head = share_linear(
        QuantWeight{WeightFormat::kDense, c_.vocab_size, c_.hidden_size, e, {}, "lm_head", {}},
        tp_share(ShareKind::kRows));
    tied_lm_head_ = be_->prepare_linear(head.w);  // a row share views the embedding: nothing copied
  }
}


void KimiK3Model::load_layer(int64_t l, int64_t& n_mla, int64_t& n_kda) {
  Backend& be = *be_;
  auto vec = [&](T id) {
    std::vector<float> v = w_.tensor_f32(int(id), l);
    return be.upload_f32(v, {static_cast<int64_t>(v.size())}, DType::kF32);
  };
  K3Layer L;
  L.input_norm = vec(T::kInputNorm);
  L.post_norm = vec(T::kPostAttnNorm);
  L.attn_res_norm = vec(T::kAttnResNorm);
  L.attn_res_proj = vec(T::kAttnResProj);
  L.mlp_res_norm = vec(T::kMlpResNorm);
  L.mlp_res_proj = vec(T::kMlpResProj);
  if (c_.is_moe_layer(l)) {
    if (c_.n_shared_experts > 0) {
      L.ffn_in = lin_.group(kMoeIn, l);
      L.shared_in = lin_.group(kSharedIn, l);
      L.ffn_in.strided_parts = L.shared_in.strided_parts = true;  // the MoE's input, glu: both read strided parts
    }
    if (c_.latent_norm) L.latent_norm = vec(T::kLatentNorm);
    L.moe.router = &lin_.get(int(T::kRouterGate), l);
    L.moe.router_bias = vec(T::kRouterBias);
    auto source = [&](int32_t e) -> moe::ExpertSource {
      return {w_.linear(int(T::kExpertW1), l, e), w_.linear(int(T::kExpertW3), l, e),
              w_.linear(int(T::kExpertW2), l, e)};
    };
    L.moe.experts = moe::ExpertTable(
        be, experts_at_, lin_.experts(int(T::kExpertW1), int(T::kExpertW3), int(T::kExpertW2), l, c_.n_experts),
        streamed_experts(residency_, experts_at_, l, source));
  }
  if (!c_.is_moe_layer(l)) {
    L.ffn_in = lin_.group(kMlpIn, l);
    L.ffn_in.strided_parts = true;  // glu reads strided parts
  }
  if (c_.is_mla(l)) {
    L.sub_index = n_mla++;
    if (c_.q_lora_rank > 0) {
      L.mla.q_a = &lin_.get(int(T::kMlaQA), l);
      L.mla.q_b = &lin_.get(int(T::kMlaQB), l);
      L.mla.q_a_norm = vec(T::kMlaQANorm);
    } else {
      L.mla.q = &lin_.get(int(T::kMlaQ), l);
    }
    L.mla.kv_a = &lin_.get(int(T::kMlaKvA), l);
    L.mla.kv_a_norm = vec(T::kMlaKvANorm);
    L.mla.o = &lin_.get(int(T::kMlaO), l);
    if (c_.mla_output_gate) L.mla.gate = &lin_.get(int(T::kMlaG), l);
    L.mla.set_kv_b(be, w_.linear(int(T::kMlaKvB), l), mla_dims_, tp_rank() * mla_dims_.n_heads);
    L.mla.in = lin_.group(mla_in(c_.q_lora_rank > 0, c_.mla_output_gate), l);
    // mla_block_forward hands q_a's, kv_a's and the gate's columns to rmsnorm, the q_b linear, mla_write_normed and
    // sigmoid_mul, which all read strided views; a plain q_proj's output goes to the attention, which needs it packed.
    L.mla.in.strided_parts = c_.q_lora_rank > 0;
  } else {
    L.sub_index = n_kda++;
    L.kda_in = lin_.group(kKdaIn, l);
    L.kda_in.strided_parts = true;  // kda_prep, gated_rmsnorm's gate and linear read strided parts
    // This rank's heads: channel rows [tp_rank * P, (tp_rank + 1) * P) of the conv weights and dt_bias.
    const int64_t P = kda_heads_ * c_.kda_head_dim, W = c_.conv_kernel;
    const int32_t tp = tp_size(), part = tp_rank();
    auto conv = [&](T id) {
      return be.upload_f32(share_rows(w_.tensor_f32(int(id), l), c_.kda_proj_dim(), tp, part, "KDA conv"), {P, W},
                           DType::kF32);
    };
    L.q_conv = conv(T::kKdaQConv);
    L.k_conv = conv(T::kKdaKConv);
    L.v_conv = conv(T::kKdaVConv);
    const TensorView& a_log = w_.tensor(int(T::kKdaALog), l);
    BG_CHECK(a_log.rank() == 1 && a_log.dim(0) >= c_.kda_heads, "tensor '{}' in {}: shape {} but at least [{}] "
             "(one per KDA head) is needed", a_log.name, w_.source().file_of(a_log.name), shape_str(a_log.shape),
             c_.kda_heads);
    std::vector<float> a = a_log.to_f32();
    a.resize(static_cast<size_t>(c_.kda_heads));  // the stored tail beyond num_heads is padding
    L.a_log = be.upload_f32(share_rows(a, c_.kda_heads, tp, part, "KDA A_log"), {kda_heads_}, DType::kF32);
    const std::vector<float> dt = share_rows(w_.tensor_f32(int(T::kKdaDtBias), l), c_.kda_proj_dim(), tp, part,
                                             "KDA dt_bias");
    L.dt_bias = be.upload_f32(dt, {P}, DType::kF32);
    L.o_norm = vec(T::kKdaONorm);
  }
  layers_.push_back(std::move(L));
}

Tensor KimiK3Model::step_body(const StepPools& pools, bool all_rows, const TapFn* tap) {
  Backend& be = *be_;
  const int64_t n = be.step().n_tokens(), H = c_.hidden_size, B = c_.attn_res_block_size;

  // Attention Residuals: bank slots 0..n_banked-1 hold the raw inputs of layers 0, B, 2B, ...; slot n_banked is the
  // running partial sum of the current block. Banking just moves the boundary.
  const int64_t n_slots = (c_.n_layers + B - 1) / B + 1;
  Tensor bank = be.alloc({n_slots, n, H}, be.act_dtype());  // [slots, n, H]
  int64_t n_banked = 0;
  bool partial_empty = false;
  auto partial = [&] { return bank.rows_view(n_banked, 1).reshaped({n, H}); };
  Tensor h = be.act(n, H), x = be.act(n, H), y = be.act(n, H);  // [n, H]
  Tensor p0 = partial();
  be.embedding(embed_, p0);
  tap_tensor(*be_, tap, "embed", 0, p0);
  const float eps = static_cast<float>(c_.rms_norm_eps);
  // A sublayer's output goes into the partial sum (slot n_banked) right before the next mix reads it; without taps
  // that update is folded into the mix (attn_res_add_mix_rmsnorm: one kernel on CUDA). pending: the output not yet
  // added; pending_replace: it starts the partial sum (copied, not added).
  Tensor pending;
  bool pending_replace = false;
  auto update = [&](const Tensor& out, bool replace) {
    if (tap == nullptr) {
      pending = out;
      pending_replace = replace;
      return;
    }
    Tensor p = partial();  // with taps the update is its own op, so the "layer" tap sees the partial sum
    be.attn_res_update(out, replace, p);
  };
  auto mix = [&](int64_t n_candidates, const Tensor& norm, const Tensor& proj, const Tensor& rms_weight) {
    if (pending.empty()) {
      be.attn_res_mix_rmsnorm(bank, n_candidates, norm, proj, eps, h, rms_weight, eps, x);
    } else {
      be.attn_res_add_mix_rmsnorm(pending, pending_replace, bank, n_candidates, norm, proj, eps, h, rms_weight, eps,
                                  x);
      pending = Tensor{};
    }
  };
  for (int64_t l = 0; l < c_.n_layers; ++l) {
    const K3Layer& L = layers_[static_cast<size_t>(l)];
    if (n_banked == 0) {
      be.rmsnorm(partial(), L.input_norm, eps, x);  // layer 0's input is the embedding itself (no mix: h not needed)
    } else {
      mix(n_banked + (partial_empty ? 0 : 1), L.attn_res_norm, L.attn_res_proj, L.input_norm);
    }
    if (l % B == 0) {  // bank the RAW input of this block
      ++n_banked;
      partial_empty = true;
    }
    if (c_.is_mla(l)) {
      mla_block_forward(be, mla_dims_, L.mla, pools.kv->layer_ref(L.sub_index), x, y);
    } else {
      kda(*pools.state, l, x, y);
    }
    tp_all_reduce(y);  // TP: each rank's heads gave a partial o_proj sum
    tap_tensor(be, tap, "attn", l + 1, y);
    update(y, partial_empty);
    partial_empty = false;
    mix(n_banked + 1, L.mlp_res_norm, L.mlp_res_proj, L.post_norm);  // takes the pending y: y is free again
    ffn(l, x, y);
    tp_all_reduce(y);  // TP: partial down-projection sums (dense, shared experts) + each rank's routed rows
    tap_tensor(be, tap, "ffn", l + 1, y);
    update(y, false);
    if (tap != nullptr) tap_tensor(*be_, tap, "layer", l + 1, partial());
  }
  mix(n_banked + (partial_empty ? 0 : 1), out_res_norm_, out_res_proj_, final_norm_);
  tap_tensor(*be_, tap, "attnres_out", c_.n_layers, h);
  tap_tensor(*be_, tap, "final_norm", c_.n_layers, x);
  return lm_head_logits(tied_lm_head_ ? *tied_lm_head_ : lin_.get(int(T::kLmHead)), x, all_rows);
}

void KimiK3Model::kda(const KdaStatePool& state, int64_t layer, const Tensor& x, Tensor& out) {
  Backend& be = *be_;
  const int64_t n = x.rows(), nh = kda_heads_, K = c_.kda_head_dim, P = nh * K;  // this rank's heads
  const K3Layer& L = layers_[static_cast<size_t>(layer)];
  const int64_t idx = L.sub_index;
  // Projections of x (one fused product at decode: q, k, v, g, f_a, b) and the gate's second projection f_b, then the
  // per-token preparation (one fused op on CUDA decode steps): causal short conv + SiLU of q, k, v continuing the
  // sequence's conv states, each [n, P] = [n, nh, K]; per-head L2 norm of q, k (eps inside the sqrt, q scaled by
  // K^-0.5); the forget gate g = lb * sigmoid(exp(A_log[h]) * (f_b(f_a x) + dt_bias)) [n, nh, K]; beta =
  // sigmoid(b_proj x) [n, nh].
  const GroupProjections in(be, L.kda_in, x);
  Tensor fb = be.act(n, P);
  be.linear(lin_.get(int(T::kKdaFB), layer), in[4], fb);
  KdaPrepArgs prep;
  prep.raw = {in[0], in[1], in[2]};
  prep.conv = {L.q_conv, L.k_conv, L.v_conv};
  prep.conv_state = {state.conv_ref(idx, 0), state.conv_ref(idx, 1), state.conv_ref(idx, 2)};
  prep.g_raw = fb;
  prep.a_log = L.a_log;
  prep.dt_bias = L.dt_bias;
  prep.b = in[5];
  prep.n_heads = nh;
  prep.head_dim = K;
  prep.q_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)));
  prep.gate_lower_bound = static_cast<float>(c_.gate_lower_bound);
  Tensor q = be.act(n, P), k = be.act(n, P), v = be.act(n, P);
  Tensor g = be.alloc({n, P}, DType::kF32);
  Tensor beta = be.alloc({n, nh}, DType::kF32);
  be.kda_prep(prep, q, k, v, g, beta);
  // Gated delta rule over each sequence's recurrent state (chunked for a prefill, recurrent for one token).
  Tensor o = be.act(n, P);
  be.kda({n, nh, K, K}, q, k, v, g, beta, state.recurrent_ref(idx), o);
  // Output: per-head RMSNorm x sigmoid(g_proj x), then o_proj.
  be.gated_rmsnorm(nh, static_cast<float>(c_.rms_norm_eps), o, in[3], L.o_norm, o);
  be.linear(lin_.get(int(T::kKdaO), layer), o, out);
}

void KimiK3Model::situ_mlp(const GroupProjections& in, size_t first, T down, int64_t layer, Tensor& out) {
  Backend& be = *be_;
  const Tensor gate = in[first];  // [n, inter]; a strided view where the group's parts are read in place
  Tensor h = gate.packed() ? gate : be.act(gate.rows(), gate.cols());
  be.glu(situ_, gate, in[first + 1], h);
  be.linear(lin_.get(int(down), layer), h, out);
}

void KimiK3Model::ffn(int64_t layer, const Tensor& x, Tensor& out) {
  if (c_.is_moe_layer(layer)) {
    latent_moe(layer, x, out);
  } else {
    situ_mlp(GroupProjections(*be_, layers_[static_cast<size_t>(layer)].ffn_in, x), 0, T::kMlpDown, layer, out);
  }
}

void KimiK3Model::latent_moe(int64_t layer, const Tensor& x, Tensor& out) {
  Backend& be = *be_;
  const int64_t n = x.rows(), D = c_.latent_size;
  K3Layer& L = layers_[static_cast<size_t>(layer)];
  // This TP rank routes rows [r0, r0 + rn) of the step (all of them without TP). Route on the full hidden vector in
  // fp32: [rn, E] -> top-k [rn, k].
  const auto [r0, rn] = moe_rows(n);
  const Tensor xs = x.rows_view(r0, rn);
  moe::MoeChoice choice = moe::moe_route(be, moe_spec_, L.moe, xs, r0);
  if (rn > 0) apply_route_hook(be, route_hook_, layer, choice.ids, choice.weights);
  // Routed path in the latent: z = down(x) [rn, D]; y = sum_i w_i E_i(z) [rn, D]; y = norm(y); up(y) [rn, H]. The
  // shared experts (full width, on the un-projected x of every row; a partial sum with TP) run while the routed rows
  // are in flight. Without TP every row is routed here, and with a local exchange no rows are in flight: latent-down
  // and the shared experts' gate and up then project x together (one fused product at decode). Without TP the shared
  // experts write `out` and the latent-up product is added to it (Backend::linear_add: on CUDA one GEMM, no add).
  const bool together = rn == n && exchange().local() && c_.n_shared_experts > 0;
  const GroupProjections in(be, together ? L.ffn_in : LinearGroup{}, x);  // latent-down, shared gate, shared up
  const GroupProjections shared_in(be, together ? LinearGroup{} : L.shared_in, x);  // shared gate, shared up
  Tensor z = together ? in[0] : be.act(rn, D);
  if (!together && rn > 0) be.linear(lin_.get(int(T::kLatentDown), layer), xs, z);
  Tensor y = be.act(rn, D);  // written whole by moe_routed (accumulate false)
  const bool shared_into_out = rn == n && c_.n_shared_experts > 0;
  Tensor shared;
  bool shared_ran = false;
  auto run_shared = [&] {
    if (c_.n_shared_experts == 0) return;
    shared_ran = true;
    shared = shared_into_out ? out : be.act(n, c_.hidden_size);  // [n, H]
    situ_mlp(together ? in : shared_in, together ? 1 : 0, T::kSharedDown, layer, shared);
  };
  moe::moe_routed(be, exchange(), moe_spec_, L.moe, choice, z, y, run_shared, /*accumulate=*/false);
  if (!shared_ran) run_shared();  // no exchange round ran the overlap (no rows here)
  if (rn < n) be.fill_zero(out);  // TP: the other rows' routed part comes from the other ranks (all-reduce)
  if (rn > 0) {
    if (c_.latent_norm) be.rmsnorm(y, L.latent_norm, static_cast<float>(c_.rms_norm_eps), y);
    Tensor routed_out = out.rows_view(r0, rn);
    if (shared_into_out) {
      be.linear_add(lin_.get(int(T::kLatentUp), layer), y, routed_out);
    } else {
      be.linear(lin_.get(int(T::kLatentUp), layer), y, routed_out);
    }
  }
  if (c_.n_shared_experts > 0 && !shared_into_out) be.add(out, shared);
}

}  // namespace

std::unique_ptr<Model> load_kimi_k3(const std::filesystem::path& dir, const KimiK3Config& config,
                                    const LoadOptions& options) {
  auto source = weights::open_weight_source(dir, {options.weight_store, options.distributed_weight_config});
  ModelWeights weights = ModelWeights::bind(source, kimi_k3_table(config), bind_options(options));
  log::info("loaded kimi_k3 checkpoint {}: {} layers ({} MLA), {} experts top-{}, hidden {}", dir.string(),
            config.n_layers, count_mla(config), config.n_experts, config.n_experts_per_token, config.hidden_size);
  auto backend = make_backend(options.device,
                              {.deterministic = options.deterministic, .background_plans = options.background_plans});
  return std::make_unique<KimiK3Model>(config, std::move(weights), std::move(backend), options);
}

}  // namespace bg

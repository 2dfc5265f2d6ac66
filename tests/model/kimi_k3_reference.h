// An independent double-precision Kimi-K3 forward written from docs/kimi_k3.md section 2. It shares nothing with the
// engine's ops, tables or config parser: config.json is read here, weights come through bg::Checkpoint +
// bg::load_linear(...).decode_all(), KDA is the plain recurrent delta rule over the whole sequence, MLA a full causal
// softmax over expanded keys/values, and every sequence is recomputed from scratch (no cache).
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "formats/quant.h"

namespace bg::testing {

using DVec = std::vector<double>;

// Everything the forward needs, from config.json. The switches after the config fields are mutations: tests flip
// them to check that a feature changes the logits (each one is a classic implementation mistake).
struct K3RefHparams {
  int64_t vocab = 0, hidden = 0, inter = 0, n_layers = 0;
  std::vector<bool> is_mla;  // [n_layers], from the 1-based full_attn_layers
  int64_t n_heads = 0, q_lora = 0, kv_lora = 0, nope = 0, rope = 0, v_head = 0;
  bool mla_gate = true;
  int64_t kda_heads = 0, kda_dim = 0, conv = 4;
  double gate_lower_bound = -5.0, situ_beta = 4.0, situ_linear_beta = 25.0;
  int64_t first_dense = 1, moe_freq = 1, n_experts = 0, top_k = 0, moe_inter = 0, latent = 0, n_shared = 0;
  int64_t n_group = 1, topk_group = 1;
  bool latent_norm = true, renormalize = true, tie_embeddings = false;
  double routed_scaling = 1.0, rms_eps = 1e-5;
  int64_t block = 1;  // attn_res_block_size
  // Derived (and mutable by tests).
  double softmax_scale = 0.0;  // 1 / sqrt(nope + rope)
  double q_scale = 0.0;        // kda_dim^-0.5
  double mla_norm_eps = 1e-6;  // q_a_layernorm / kv_a_layernorm: KimiRMSNorm's default, not rms_norm_eps
  // Mutation switches.
  bool situ_dense = true, situ_shared = true, situ_experts = true;  // false: SiLU-GLU
  bool situ_gate_clamp = true, situ_linear_clamp = true;           // false: the tanh of that factor dropped
  bool use_pe_scores = true, use_router_bias = true, latent_norm_per_expert = false, force_latent_norm = false;
  bool softplus_gate = false;   // -exp(A_log) * softplus(.) instead of the lower-bound gate
  bool kda_head_major = true;   // false: channel c = d * heads + h
  bool kda_conv = true;         // false: no short conv (SiLU only)
  bool mix_raw_values = true;   // false: the mix sums the normalised values
  bool bank_raw_input = true;   // false: bank the mixed input h instead of the raw partial sum
  bool output_mix = true;       // false: the final norm reads the last partial sum
};

namespace k3_ref_detail {

using nlohmann::json;

inline int64_t req_int(const json& o, const char* key) {
  if (!o.contains(key) || !o[key].is_number_integer()) throw std::runtime_error(std::string("reference: ") + key);
  return o[key].get<int64_t>();
}

}  // namespace k3_ref_detail

inline K3RefHparams k3_ref_hparams(const nlohmann::json& config) {
  using k3_ref_detail::req_int;
  const nlohmann::json& t = config.contains("text_config") ? config["text_config"] : config;
  const nlohmann::json& lin = t.at("linear_attn_config");
  K3RefHparams h;
  h.vocab = req_int(t, "vocab_size");
  h.hidden = req_int(t, "hidden_size");
  h.inter = req_int(t, "intermediate_size");
  h.n_layers = req_int(t, "num_hidden_layers");
  h.is_mla.assign(static_cast<size_t>(h.n_layers), false);
  for (const auto& l : lin.at("full_attn_layers")) h.is_mla.at(static_cast<size_t>(l.get<int64_t>() - 1)) = true;
  for (const auto& l : lin.at("kda_layers")) {
    if (h.is_mla.at(static_cast<size_t>(l.get<int64_t>() - 1))) throw std::runtime_error("reference: layer lists");
  }
  h.n_heads = req_int(t, "num_attention_heads");
  h.q_lora = t.contains("q_lora_rank") && !t["q_lora_rank"].is_null() ? t["q_lora_rank"].get<int64_t>() : 0;
  h.kv_lora = req_int(t, "kv_lora_rank");
  h.nope = req_int(t, "qk_nope_head_dim");
  h.rope = req_int(t, "qk_rope_head_dim");
  h.v_head = req_int(t, "v_head_dim");
  h.mla_gate = t.value("mla_use_output_gate", false);
  h.kda_heads = req_int(lin, "num_heads");
  h.kda_dim = req_int(lin, "head_dim");
  h.conv = lin.value("short_conv_kernel_size", int64_t{4});
  h.gate_lower_bound = lin.at("gate_lower_bound").get<double>();
  h.situ_beta = t.at("activation_situ_beta").get<double>();
  h.situ_linear_beta = t.at("activation_situ_linear_beta").get<double>();
  h.first_dense = t.value("first_k_dense_replace", int64_t{1});
  h.moe_freq = t.value("moe_layer_freq", int64_t{1});
  h.n_experts = req_int(t, "num_experts");
  h.top_k = req_int(t, "num_experts_per_token");
  h.moe_inter = req_int(t, "moe_intermediate_size");
  h.latent = req_int(t, "routed_expert_hidden_size");
  h.n_shared = t.value("num_shared_experts", int64_t{0});
  if (t.value("use_grouped_topk", false)) {
    h.n_group = t.value("num_expert_group", int64_t{1});
    h.topk_group = t.value("topk_group", int64_t{1});
  }
  h.latent_norm = t.value("latent_moe_use_norm", true);
  h.renormalize = t.value("moe_renormalize", true);
  h.routed_scaling = t.value("routed_scaling_factor", 1.0);
  h.rms_eps = t.value("rms_norm_eps", 1e-5);
  h.block = req_int(t, "attn_res_block_size");
  h.tie_embeddings = t.value("tie_word_embeddings", false);
  h.softmax_scale = 1.0 / std::sqrt(static_cast<double>(h.nope + h.rope));
  h.q_scale = 1.0 / std::sqrt(static_cast<double>(h.kda_dim));
  return h;
}

// y = W x with W [out, in] in double.
struct K3RefLinear {
  int64_t n_out = 0, n_in = 0;
  DVec w;
  DVec operator()(const DVec& x) const {
    DVec y(static_cast<size_t>(n_out), 0.0);
    for (int64_t o = 0; o < n_out; ++o) {
      const double* row = w.data() + o * n_in;
      double s = 0.0;
      for (int64_t i = 0; i < n_in; ++i) s += row[i] * x[static_cast<size_t>(i)];
      y[static_cast<size_t>(o)] = s;
    }
    return y;
  }
};

struct K3RefMlp {
  K3RefLinear gate, up, down;
};

struct K3RefLayer {
  DVec input_norm, post_norm, attn_res_norm, attn_res_proj, mlp_res_norm, mlp_res_proj;
  // KDA
  K3RefLinear q, k, v, g, o, f_a, f_b, b;
  DVec q_conv, k_conv, v_conv, a_log, dt_bias, o_norm;
  // MLA (o shared with KDA)
  K3RefLinear q_a, q_b, q_plain, kv_a, kv_b, mla_g;
  DVec q_a_norm, kv_a_norm;
  // FFN
  bool moe = false;
  K3RefMlp dense, shared;
  K3RefLinear router, latent_down, latent_up;
  DVec router_bias, latent_norm;
  std::vector<K3RefMlp> experts;
};

// What the init scales of a checkpoint do to the forward (the last forward's maxima and counts).
struct K3RefStats {
  double max_situ_gate = 0.0;       // max |gate pre-activation| / situ_beta
  double max_situ_up = 0.0;         // max |up pre-activation| / situ_linear_beta
  int64_t n_gate = 0, n_gate_near_bound = 0;  // KDA gate entries; those with g < 0.9 * lower bound
  double min_latent_ms = 1e30;      // smallest mean square of a q_a / kv_a latent before its norm
};

class KimiK3Reference {
 public:
  explicit KimiK3Reference(const std::filesystem::path& dir)
      : config_(read_json_file(dir / "config.json")), h_(k3_ref_hparams(config_)), ckpt_(Checkpoint::open(dir)) {
    prefix_ = config_.contains("text_config") ? "language_model." : "";
    load_weights();
  }
  K3RefHparams& hparams() { return h_; }
  const K3RefStats& stats() const { return stats_; }
  // Logits [ids.size(), vocab] of one causal forward over all ids (row t predicts token t + 1).
  DVec forward(const std::vector<int32_t>& ids) const;

 private:
  using Seq = std::vector<DVec>;  // [n_tokens][dim]
  DVec vec(const std::string& name) const {
    std::vector<float> f = ckpt_->get(prefix_ + name).to_f32();
    return DVec(f.begin(), f.end());
  }
  K3RefLinear lin(const std::string& name, int64_t n_out, int64_t n_in) const {
    std::vector<float> f = load_linear(*ckpt_, prefix_ + name, n_out, n_in).decode_all();
    return {n_out, n_in, DVec(f.begin(), f.end())};
  }
  K3RefMlp mlp(const std::string& p, const char* gate, const char* up, const char* down, int64_t in,
               int64_t inter) const {
    return {lin(p + gate, inter, in), lin(p + up, inter, in), lin(p + down, in, inter)};
  }
  void load_weights();
  void load_kda(const std::string& p, K3RefLayer& L) const;
  void load_mla(const std::string& p, K3RefLayer& L) const;
  void load_moe(const std::string& p, K3RefLayer& L) const;
  static void rmsnorm(DVec& x, const DVec& w, double eps);
  DVec situ_mlp(const K3RefMlp& m, const DVec& x, bool situ) const;
  Seq kda(const K3RefLayer& L, const Seq& x) const;
  Seq mla(const K3RefLayer& L, const Seq& x) const;
  DVec moe(const K3RefLayer& L, const DVec& x) const;
  DVec mix(const std::vector<const Seq*>& cands, size_t t, const DVec& norm, const DVec& proj) const;

  nlohmann::json config_;
  K3RefHparams h_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::string prefix_;
  DVec embed_, final_norm_, out_res_norm_, out_res_proj_;
  K3RefLinear lm_head_;
  std::vector<K3RefLayer> layers_;
  mutable K3RefStats stats_;
};


inline void KimiK3Reference::load_kda(const std::string& p, K3RefLayer& L) const {
  const int64_t H = h_.hidden, K = h_.kda_dim, P = h_.kda_heads * K;
  L.q = lin(p + "q_proj", P, H);
  L.k = lin(p + "k_proj", P, H);
  L.v = lin(p + "v_proj", P, H);
  L.g = lin(p + "g_proj", P, H);
  L.o = lin(p + "o_proj", H, P);
  L.f_a = lin(p + "f_a_proj", K, H);
  L.f_b = lin(p + "f_b_proj", P, K);
  L.b = lin(p + "b_proj", h_.kda_heads, H);
  L.q_conv = vec(p + "q_conv1d.weight");  // [P, 1, W]
  L.k_conv = vec(p + "k_conv1d.weight");
  L.v_conv = vec(p + "v_conv1d.weight");
  L.a_log = vec(p + "A_log");  // [>= heads]: only the first kda_heads entries are used
  L.dt_bias = vec(p + "dt_bias");
  L.o_norm = vec(p + "o_norm.weight");
  if (static_cast<int64_t>(L.q_conv.size()) != P * h_.conv || static_cast<int64_t>(L.a_log.size()) < h_.kda_heads) {
    throw std::runtime_error("reference: KDA tensor sizes in " + p);
  }
}

inline void KimiK3Reference::load_mla(const std::string& p, K3RefLayer& L) const {
  const int64_t H = h_.hidden, nh = h_.n_heads, qk = h_.nope + h_.rope;
  if (h_.q_lora > 0) {
    L.q_a = lin(p + "q_a_proj", h_.q_lora, H);
    L.q_a_norm = vec(p + "q_a_layernorm.weight");
    L.q_b = lin(p + "q_b_proj", nh * qk, h_.q_lora);
  } else {
    L.q_plain = lin(p + "q_proj", nh * qk, H);
  }
  L.kv_a = lin(p + "kv_a_proj_with_mqa", h_.kv_lora + h_.rope, H);
  L.kv_a_norm = vec(p + "kv_a_layernorm.weight");
  L.kv_b = lin(p + "kv_b_proj", nh * (h_.nope + h_.v_head), h_.kv_lora);
  if (h_.mla_gate) L.mla_g = lin(p + "g_proj", nh * h_.v_head, H);
  L.o = lin(p + "o_proj", H, nh * h_.v_head);
}

inline void KimiK3Reference::load_moe(const std::string& p, K3RefLayer& L) const {
  const int64_t H = h_.hidden, D = h_.latent;
  L.router = lin(p + "gate", h_.n_experts, H);
  L.router_bias = vec(p + "gate.e_score_correction_bias");
  L.latent_down = lin(p + "routed_expert_down_proj", D, H);
  if (h_.latent_norm) L.latent_norm = vec(p + "routed_expert_norm.weight");
  L.latent_up = lin(p + "routed_expert_up_proj", H, D);
  for (int64_t e = 0; e < h_.n_experts; ++e) {  // w1 = gate, w3 = up, w2 = down, all in the latent
    L.experts.push_back(mlp(p + "experts." + std::to_string(e) + ".", "w1", "w3", "w2", D, h_.moe_inter));
  }
  if (h_.n_shared > 0) {
    L.shared = mlp(p + "shared_experts.", "gate_proj", "up_proj", "down_proj", H, h_.n_shared * h_.moe_inter);
  }
}

inline void KimiK3Reference::load_weights() {
  const int64_t H = h_.hidden;
  embed_ = vec("model.embed_tokens.weight");
  final_norm_ = vec("model.norm.weight");
  out_res_norm_ = vec("model.output_attn_res_norm.weight");
  out_res_proj_ = vec("model.output_attn_res_proj.weight");
  lm_head_ = h_.tie_embeddings ? K3RefLinear{h_.vocab, H, embed_} : lin("lm_head", h_.vocab, H);
  for (int64_t l = 0; l < h_.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    K3RefLayer L;
    L.input_norm = vec(p + "input_layernorm.weight");
    L.post_norm = vec(p + "post_attention_layernorm.weight");
    L.attn_res_norm = vec(p + "self_attention_res_norm.weight");
    L.attn_res_proj = vec(p + "self_attention_res_proj.weight");
    L.mlp_res_norm = vec(p + "mlp_res_norm.weight");
    L.mlp_res_proj = vec(p + "mlp_res_proj.weight");
    if (h_.is_mla[static_cast<size_t>(l)]) {
      load_mla(p + "self_attn.", L);
    } else {
      load_kda(p + "self_attn.", L);
    }
    L.moe = h_.n_experts > 0 && l >= h_.first_dense && l % h_.moe_freq == 0;
    if (L.moe) {
      load_moe(p + "block_sparse_moe.", L);
    } else {
      L.dense = mlp(p + "mlp.", "gate_proj", "up_proj", "down_proj", H, h_.inter);
    }
    layers_.push_back(std::move(L));
  }
}

// x <- w * x / sqrt(mean(x^2) + eps); an empty w is all ones.
inline void KimiK3Reference::rmsnorm(DVec& x, const DVec& w, double eps) {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  const double r = 1.0 / std::sqrt(ms / static_cast<double>(x.size()) + eps);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (w.empty() ? 1.0 : w[i]) * x[i] * r;
}

inline double k3_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// down( [b tanh(g/b) sigmoid(g)] * [b_lin tanh(u/b_lin)] ), or SiLU-GLU down(silu(g) * u).
inline DVec KimiK3Reference::situ_mlp(const K3RefMlp& m, const DVec& x, bool situ) const {
  DVec g = m.gate(x), u = m.up(x);
  const double b = h_.situ_beta, bl = h_.situ_linear_beta;
  for (size_t i = 0; i < g.size(); ++i) {
    stats_.max_situ_gate = std::max(stats_.max_situ_gate, std::fabs(g[i]) / b);
    stats_.max_situ_up = std::max(stats_.max_situ_up, std::fabs(u[i]) / bl);
    if (!situ) {
      g[i] = g[i] * k3_sigmoid(g[i]) * u[i];
      continue;
    }
    const double gate = (h_.situ_gate_clamp ? b * std::tanh(g[i] / b) : g[i]) * k3_sigmoid(g[i]);
    g[i] = gate * (h_.situ_linear_clamp ? bl * std::tanh(u[i] / bl) : u[i]);
  }
  return m.down(g);
}

// KDA over the whole sequence: projections, causal depthwise conv (zero left padding) + SiLU, per-head L2 norm
// (eps inside the sqrt) with q * K^-0.5, lower-bound gate, sigmoid beta, the recurrent gated delta rule on
// S[k][v] (decay rows, u = v - S^T k, S += beta k u^T, o = S^T q), RMSNorm(o) * sigmoid(g_proj x), o_proj.
inline KimiK3Reference::Seq KimiK3Reference::kda(const K3RefLayer& L, const Seq& x) const {
  const int64_t n = static_cast<int64_t>(x.size()), nh = h_.kda_heads, K = h_.kda_dim, P = nh * K, W = h_.conv;
  auto ch = [&](int64_t hd, int64_t d) { return static_cast<size_t>(h_.kda_head_major ? hd * K + d : d * nh + hd); };
  auto conv = [&](const K3RefLinear& proj, const DVec& w) {
    Seq raw(static_cast<size_t>(n)), out(static_cast<size_t>(n), DVec(static_cast<size_t>(P)));
    for (int64_t t = 0; t < n; ++t) raw[static_cast<size_t>(t)] = proj(x[static_cast<size_t>(t)]);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t c = 0; c < P; ++c) {
        double s = 0.0;
        for (int64_t j = 0; j < W; ++j) {
          const int64_t src = t - (W - 1) + j;  // tap W-1 reads the current token
          if (src >= 0) s += w[static_cast<size_t>(c * W + j)] * raw[static_cast<size_t>(src)][static_cast<size_t>(c)];
        }
        if (!h_.kda_conv) s = raw[static_cast<size_t>(t)][static_cast<size_t>(c)];
        out[static_cast<size_t>(t)][static_cast<size_t>(c)] = s * k3_sigmoid(s);
      }
    }
    return out;
  };
  const Seq q = conv(L.q, L.q_conv), k = conv(L.k, L.k_conv), v = conv(L.v, L.v_conv);
  std::vector<DVec> S(static_cast<size_t>(nh), DVec(static_cast<size_t>(K * K), 0.0));  // S[k * K + v]
  Seq out(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    const DVec& xt = x[static_cast<size_t>(t)];
    const DVec gt = L.f_b(L.f_a(xt)), braw = L.b(xt), gout = L.g(xt);
    DVec concat(static_cast<size_t>(P));
    for (int64_t hd = 0; hd < nh; ++hd) {
      DVec qh(static_cast<size_t>(K)), kh(qh.size()), vh(qh.size()), a(qh.size()), o(qh.size(), 0.0);
      double qs = 0.0, ks = 0.0;
      for (int64_t d = 0; d < K; ++d) {
        qh[d] = q[t][ch(hd, d)];
        kh[d] = k[t][ch(hd, d)];
        vh[d] = v[t][ch(hd, d)];
        qs += qh[d] * qh[d];
        ks += kh[d] * kh[d];
      }
      for (int64_t d = 0; d < K; ++d) {
        qh[d] *= h_.q_scale / std::sqrt(qs + 1e-6);
        kh[d] /= std::sqrt(ks + 1e-6);
        const double z = gt[ch(hd, d)] + L.dt_bias[ch(hd, d)], A = std::exp(L.a_log[static_cast<size_t>(hd)]);
        const double g = h_.softplus_gate ? -A * std::log1p(std::exp(z)) : h_.gate_lower_bound * k3_sigmoid(A * z);
        ++stats_.n_gate;
        if (g < 0.9 * h_.gate_lower_bound) ++stats_.n_gate_near_bound;
        a[d] = std::exp(g);
      }
      const double beta = k3_sigmoid(braw[static_cast<size_t>(hd)]);
      DVec& s = S[static_cast<size_t>(hd)];
      for (int64_t i = 0; i < K; ++i) {
        for (int64_t j = 0; j < K; ++j) s[i * K + j] *= a[i];
      }
      for (int64_t j = 0; j < K; ++j) {
        double u = vh[j];
        for (int64_t i = 0; i < K; ++i) u -= s[i * K + j] * kh[i];
        for (int64_t i = 0; i < K; ++i) s[i * K + j] += beta * kh[i] * u;
        for (int64_t i = 0; i < K; ++i) o[j] += s[i * K + j] * qh[i];
      }
      rmsnorm(o, L.o_norm, h_.rms_eps);
      for (int64_t j = 0; j < K; ++j) concat[ch(hd, j)] = o[j] * k3_sigmoid(gout[ch(hd, j)]);
    }
    out[static_cast<size_t>(t)] = L.o(concat);
  }
  return out;
}

// MLA NoPE: q = q_b(norm(q_a x)), [c | k_pe] = kv_a x, [k_nope | v] = kv_b(norm(c)) per head; scores
// (q_nope.k_nope + q_pe.k_pe) / sqrt(nope + rope) over tokens <= t; output * sigmoid(g_proj x); o_proj.
inline KimiK3Reference::Seq KimiK3Reference::mla(const K3RefLayer& L, const Seq& x) const {
  const size_t n = x.size();
  const int64_t nh = h_.n_heads, qk = h_.nope + h_.rope, kvd = h_.nope + h_.v_head;
  auto mean_square = [](const DVec& v) {
    double s = 0.0;
    for (double e : v) s += e * e;
    return s / static_cast<double>(v.size());
  };
  Seq q(n), kv(n), k_pe(n), out(n);
  for (size_t t = 0; t < n; ++t) {
    if (h_.q_lora > 0) {
      DVec cq = L.q_a(x[t]);
      stats_.min_latent_ms = std::min(stats_.min_latent_ms, mean_square(cq));
      rmsnorm(cq, L.q_a_norm, h_.mla_norm_eps);
      q[t] = L.q_b(cq);
    } else {
      q[t] = L.q_plain(x[t]);
    }
    DVec kva = L.kv_a(x[t]);
    DVec c(kva.begin(), kva.begin() + h_.kv_lora);
    k_pe[t].assign(kva.begin() + h_.kv_lora, kva.end());
    stats_.min_latent_ms = std::min(stats_.min_latent_ms, mean_square(c));
    rmsnorm(c, L.kv_a_norm, h_.mla_norm_eps);
    kv[t] = L.kv_b(c);
  }
  for (size_t t = 0; t < n; ++t) {
    DVec concat(static_cast<size_t>(nh * h_.v_head), 0.0);
    for (int64_t hd = 0; hd < nh; ++hd) {
      const double* qh = q[t].data() + hd * qk;
      DVec score(t + 1);
      for (size_t s = 0; s <= t; ++s) {
        const double* kn = kv[s].data() + hd * kvd;
        double dot = 0.0;
        for (int64_t i = 0; i < h_.nope; ++i) dot += qh[i] * kn[i];
        if (h_.use_pe_scores) {
          for (int64_t i = 0; i < h_.rope; ++i) dot += qh[h_.nope + i] * k_pe[s][static_cast<size_t>(i)];
        }
        score[s] = dot * h_.softmax_scale;
      }
      const double mx = *std::max_element(score.begin(), score.end());
      double sum = 0.0;
      for (double& e : score) sum += (e = std::exp(e - mx));
      for (size_t s = 0; s <= t; ++s) {
        const double* vs = kv[s].data() + hd * kvd + h_.nope;
        double* dst = concat.data() + hd * h_.v_head;
        for (int64_t i = 0; i < h_.v_head; ++i) dst[i] += score[s] / sum * vs[i];
      }
    }
    if (h_.mla_gate) {
      DVec g = L.mla_g(x[t]);
      for (size_t i = 0; i < concat.size(); ++i) concat[i] *= k3_sigmoid(g[i]);
    }
    out[t] = L.o(concat);
  }
  return out;
}

// Sigmoid router in double on the full x; the bias only for selection; DeepSeek noaux_tc groups (top-2 sum, the
// other groups' choices set to 0); top-k; weights renormalised and scaled. Routed experts in the latent, their
// weighted sum normalised, projected up; shared experts on the full x.
inline DVec KimiK3Reference::moe(const K3RefLayer& L, const DVec& x) const {
  const int64_t E = h_.n_experts, per_group = E / h_.n_group;
  DVec logits = L.router(x), s(static_cast<size_t>(E)), choice(s.size());
  for (int64_t e = 0; e < E; ++e) {
    s[e] = k3_sigmoid(logits[e]);
    choice[e] = s[e] + (h_.use_router_bias ? L.router_bias[e] : 0.0);
  }
  if (h_.n_group > 1) {
    DVec group_score(static_cast<size_t>(h_.n_group));
    for (int64_t g = 0; g < h_.n_group; ++g) {
      DVec m(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(m.rbegin(), m.rend());
      group_score[g] = m[0] + (per_group > 1 ? m[1] : 0.0);
    }
    std::vector<int64_t> order(static_cast<size_t>(h_.n_group));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
    for (int64_t r = h_.topk_group; r < h_.n_group; ++r) {
      std::fill(choice.begin() + order[r] * per_group, choice.begin() + (order[r] + 1) * per_group, 0.0);
    }
  }
  std::vector<int64_t> idx(static_cast<size_t>(E));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
  double sum = 0.0;
  for (int64_t i = 0; i < h_.top_k; ++i) sum += s[idx[i]];
  const DVec z = L.latent_down(x);
  DVec y(static_cast<size_t>(h_.latent), 0.0);
  for (int64_t i = 0; i < h_.top_k; ++i) {
    const int64_t e = idx[i];
    const double w = (h_.renormalize ? s[e] / (sum + 1e-20) : s[e]) * h_.routed_scaling;
    DVec ye = situ_mlp(L.experts[static_cast<size_t>(e)], z, h_.situ_experts);
    if (h_.latent_norm_per_expert) rmsnorm(ye, L.latent_norm, h_.rms_eps);
    for (size_t d = 0; d < y.size(); ++d) y[d] += w * ye[d];
  }
  if ((h_.latent_norm && !h_.latent_norm_per_expert) || h_.force_latent_norm) rmsnorm(y, L.latent_norm, h_.rms_eps);
  DVec out = L.latent_up(y);
  if (h_.n_shared > 0) {
    DVec sh = situ_mlp(L.shared, x, h_.situ_shared);
    for (size_t i = 0; i < out.size(); ++i) out[i] += sh[i];
  }
  return out;
}

// Mix(V; n, p) at token t: s_i = sum_d (V_i rsqrt(mean(V_i^2) + eps))_d n_d p_d, softmax, sum_i alpha_i V_i (raw).
inline DVec KimiK3Reference::mix(const std::vector<const Seq*>& cands, size_t t, const DVec& norm,
                                 const DVec& proj) const {
  const size_t m = cands.size(), H = static_cast<size_t>(h_.hidden);
  DVec score(m), r(m);
  for (size_t i = 0; i < m; ++i) {
    const DVec& v = (*cands[i])[t];
    double ms = 0.0;
    for (double e : v) ms += e * e;
    r[i] = 1.0 / std::sqrt(ms / static_cast<double>(H) + h_.rms_eps);
    double s = 0.0;
    for (size_t d = 0; d < H; ++d) s += v[d] * r[i] * norm[d] * proj[d];
    score[i] = s;
  }
  const double mx = *std::max_element(score.begin(), score.end());
  double sum = 0.0;
  for (double& e : score) sum += (e = std::exp(e - mx));
  DVec out(H, 0.0);
  for (size_t i = 0; i < m; ++i) {
    const double w = score[i] / sum * (h_.mix_raw_values ? 1.0 : r[i]);
    for (size_t d = 0; d < H; ++d) out[d] += w * (*cands[i])[t][d];
  }
  return out;
}

// The AttnRes loop of docs/kimi_k3.md: bank the raw layer input every `block` layers, mix before attention and
// before the FFN over the banks plus the running partial sum, and once more before the final norm.
inline DVec KimiK3Reference::forward(const std::vector<int32_t>& ids) const {
  const size_t n = ids.size();
  const int64_t H = h_.hidden;
  stats_ = {};
  Seq p(n);
  for (size_t t = 0; t < n; ++t) p[t].assign(embed_.begin() + ids[t] * H, embed_.begin() + (ids[t] + 1) * H);
  bool p_none = false;
  std::vector<Seq> blocks;
  blocks.reserve(static_cast<size_t>(h_.n_layers) + 1);
  auto cands = [&] {
    std::vector<const Seq*> c;
    for (const Seq& b : blocks) c.push_back(&b);
    if (!p_none) c.push_back(&p);
    return c;
  };
  for (int64_t l = 0; l < h_.n_layers; ++l) {
    const K3RefLayer& L = layers_[static_cast<size_t>(l)];
    Seq h(n);
    for (size_t t = 0; t < n; ++t) h[t] = blocks.empty() ? p[t] : mix(cands(), t, L.attn_res_norm, L.attn_res_proj);
    if (l % h_.block == 0) {
      blocks.push_back(h_.bank_raw_input ? p : h);
      p_none = true;
    }
    for (auto& ht : h) rmsnorm(ht, L.input_norm, h_.rms_eps);
    Seq a = h_.is_mla[static_cast<size_t>(l)] ? mla(L, h) : kda(L, h);
    for (size_t t = 0; t < n; ++t) {
      if (p_none) p[t].assign(static_cast<size_t>(H), 0.0);
      for (int64_t i = 0; i < H; ++i) p[t][i] += a[t][i];
    }
    p_none = false;
    for (size_t t = 0; t < n; ++t) {
      DVec xt = mix(cands(), t, L.mlp_res_norm, L.mlp_res_proj);
      rmsnorm(xt, L.post_norm, h_.rms_eps);
      DVec y = L.moe ? moe(L, xt) : situ_mlp(L.dense, xt, h_.situ_dense);
      for (int64_t i = 0; i < H; ++i) p[t][i] += y[i];
    }
  }
  DVec logits;
  for (size_t t = 0; t < n; ++t) {
    DVec out = h_.output_mix ? mix(cands(), t, out_res_norm_, out_res_proj_) : p[t];
    rmsnorm(out, final_norm_, h_.rms_eps);
    DVec row = lm_head_(out);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

}  // namespace bg::testing

// An independent double-precision DeepSeek-V3 forward written from docs/reference.md section 1 (the formulas of
// transformers' DeepseekV3ForCausalLM). It shares nothing with the engine's ops, tables or config parser: config.json
// is read with transformers' own rules (legacy rope_scaling, `x or default`, the YaRN factor from
// max_position_embeddings / original_max_position_embeddings), weights come through bg::Checkpoint +
// bg::load_linear(...).decode_all(), and attention is the plain (non-absorbed) MLA over a full causal recompute.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numbers>
#include <numeric>
#include <string>
#include <vector>

#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "formats/quant.h"

namespace bg::testing {

using DVec = std::vector<double>;

// Everything the forward needs, as transformers derives it. Tests mutate fields to check that they matter.
struct RefHparams {
  int64_t vocab = 0, hidden = 0, inter = 0, moe_inter = 0, n_layers = 0, n_heads = 0;
  int64_t q_lora = 0;  // 0: q_lora_rank null -> a single q_proj
  int64_t kv_lora = 0, nope = 0, rope = 0, v_head = 0;
  int64_t n_experts = 0, n_shared = 0, top_k = 0, n_group = 1, topk_group = 1, first_dense = 0;
  double routed_scaling = 1.0, rms_eps = 1e-6;
  bool norm_topk = true, rope_interleave = true, tie_embeddings = false;
  bool use_router_bias = true;         // mutation switch only
  DVec inv_freq;                       // [rope / 2]
  double rope_attention_factor = 1.0;  // multiplies cos and sin
  double softmax_scale = 0.0;
};

namespace ref_detail {

using nlohmann::json;

inline bool truthy(const json& obj, const std::string& key) {
  if (!obj.contains(key) || obj[key].is_null()) return false;
  const json& v = obj[key];
  return v.is_boolean() ? v.get<bool>() : (v.is_number() ? v.get<double>() != 0.0 : true);
}
// transformers' `d.get(key) or fallback`.
inline double number_or(const json& obj, const std::string& key, double fallback) {
  return truthy(obj, key) ? obj[key].get<double>() : fallback;
}
inline double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// rope_parameters (v5), or a legacy rope_scaling dict ("type" -> "rope_type") with the top-level rope_theta.
inline json rope_parameters(const json& c) {
  json rp = json::object();
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    rp = c["rope_parameters"];
  } else if (c.contains("rope_scaling") && c["rope_scaling"].is_object()) {
    rp = c["rope_scaling"];
  }
  if (!rp.contains("rope_type") && rp.contains("type")) rp["rope_type"] = rp["type"];
  if (!rp.contains("rope_type")) rp["rope_type"] = "default";
  if (!rp.contains("rope_theta")) rp["rope_theta"] = c.value("rope_theta", 10000.0);
  return rp;
}

// inv_freq, the cos/sin attention factor and the softmax scale (reference.md "YaRN" and "Softmax scale").
inline void set_rope(const json& c, RefHparams& h) {
  const json rp = rope_parameters(c);
  const std::string type = rp["rope_type"].get<std::string>();
  const double base = rp["rope_theta"].get<double>(), dim = static_cast<double>(h.rope);
  const int64_t half = h.rope / 2;
  h.inv_freq.assign(half, 0.0);
  h.softmax_scale = 1.0 / std::sqrt(static_cast<double>(h.nope + h.rope));
  auto pos_freq = [&](int64_t i) { return std::pow(base, 2.0 * static_cast<double>(i) / dim); };
  if (type == "default") {
    for (int64_t i = 0; i < half; ++i) h.inv_freq[i] = 1.0 / pos_freq(i);
    h.rope_attention_factor = 1.0;
    return;
  }
  if (type != "yarn") throw std::runtime_error("reference: rope type " + type);
  const double config_factor = rp["factor"].get<double>();
  const double max_positions = static_cast<double>(c.value("max_position_embeddings", int64_t{4096}));
  double factor = config_factor, original = max_positions;
  if (rp.contains("original_max_position_embeddings") && !rp["original_max_position_embeddings"].is_null()) {
    original = rp["original_max_position_embeddings"].get<double>();
    factor = max_positions / original;
  }
  if (truthy(rp, "attention_factor")) {
    h.rope_attention_factor = rp["attention_factor"].get<double>();
  } else if (truthy(rp, "mscale") && truthy(rp, "mscale_all_dim")) {
    h.rope_attention_factor = yarn_get_mscale(factor, rp["mscale"].get<double>()) /
                              yarn_get_mscale(factor, rp["mscale_all_dim"].get<double>());
  } else {
    h.rope_attention_factor = yarn_get_mscale(factor, 1.0);
  }
  const double beta_fast = number_or(rp, "beta_fast", 32.0), beta_slow = number_or(rp, "beta_slow", 1.0);
  const bool truncate = !rp.contains("truncate") || rp["truncate"].get<bool>();
  auto correction_dim = [&](double n_rot) {
    return dim * std::log(original / (n_rot * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    double inv_ext = 1.0 / pos_freq(i), inv_int = 1.0 / (factor * pos_freq(i));
    h.inv_freq[i] = inv_int * ramp + inv_ext * (1.0 - ramp);
  }
  // DeepseekV3Attention: the config's own factor, not the max/original ratio.
  const double mscale_all_dim =
      rp.contains("mscale_all_dim") && !rp["mscale_all_dim"].is_null() ? rp["mscale_all_dim"].get<double>() : 0.0;
  if (mscale_all_dim != 0.0) {
    double m = yarn_get_mscale(config_factor, mscale_all_dim);
    h.softmax_scale *= m * m;
  }
}

// An absent key takes DeepseekV3Config's default (docs/reference.md "Config fields and defaults").
inline int64_t hf_int(const json& c, const std::string& key, int64_t hf_default) {
  return c.contains(key) ? c[key].get<int64_t>() : hf_default;
}

}  // namespace ref_detail

inline RefHparams ref_hparams(const nlohmann::json& c) {
  using ref_detail::hf_int;
  RefHparams h;
  h.vocab = hf_int(c, "vocab_size", 129280);
  h.hidden = hf_int(c, "hidden_size", 7168);
  h.inter = hf_int(c, "intermediate_size", 18432);
  h.moe_inter = hf_int(c, "moe_intermediate_size", 2048);
  h.n_layers = hf_int(c, "num_hidden_layers", 61);
  h.n_heads = hf_int(c, "num_attention_heads", 128);
  // q_lora_rank: null means a single q_proj; absent means the default rank.
  h.q_lora = !c.contains("q_lora_rank") ? 1536 : (c["q_lora_rank"].is_null() ? 0 : c["q_lora_rank"].get<int64_t>());
  h.kv_lora = hf_int(c, "kv_lora_rank", 512);
  h.nope = hf_int(c, "qk_nope_head_dim", 128);
  h.rope = hf_int(c, "qk_rope_head_dim", 64);
  h.v_head = hf_int(c, "v_head_dim", 128);
  h.n_experts = hf_int(c, "n_routed_experts", 256);
  h.n_shared = hf_int(c, "n_shared_experts", 1);
  h.top_k = hf_int(c, "num_experts_per_tok", 8);
  h.n_group = hf_int(c, "n_group", 8);
  h.topk_group = hf_int(c, "topk_group", 4);
  h.first_dense = hf_int(c, "first_k_dense_replace", 3);
  h.routed_scaling = c.value("routed_scaling_factor", 2.5);
  h.rms_eps = c.value("rms_norm_eps", 1e-6);
  h.norm_topk = c.value("norm_topk_prob", true);
  h.rope_interleave = c.value("rope_interleave", true);
  h.tie_embeddings = c.value("tie_word_embeddings", false);
  ref_detail::set_rope(c, h);
  return h;
}

// y = W x with W [out, in] in double.
struct RefLinear {
  int64_t n_out = 0, n_in = 0;
  DVec w;
  DVec operator()(const DVec& x) const {
    DVec y(n_out, 0.0);
    for (int64_t o = 0; o < n_out; ++o) {
      const double* row = w.data() + o * n_in;
      double s = 0.0;
      for (int64_t i = 0; i < n_in; ++i) s += row[i] * x[i];
      y[o] = s;
    }
    return y;
  }
};

struct RefMlp {
  RefLinear gate, up, down;
  DVec operator()(const DVec& x) const {  // down(silu(gate x) * up x)
    DVec g = gate(x), u = up(x);
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    return down(g);
  }
};

struct RefLayer {
  DVec input_norm, post_norm, q_a_norm, kv_a_norm;
  RefLinear q, q_a, q_b, kv_a, kv_b, o;
  bool moe = false;
  RefMlp dense, shared;
  RefLinear router;
  DVec router_bias;
  std::vector<RefMlp> experts;
};

class DeepseekV3Reference {
 public:
  explicit DeepseekV3Reference(const std::filesystem::path& dir)
      : config_(read_json_file(dir / "config.json")), h_(ref_hparams(config_)), ckpt_(Checkpoint::open(dir)) {
    load_weights();
  }
  RefHparams& hparams() { return h_; }
  const nlohmann::json& config() const { return config_; }
  // Logits [ids.size(), vocab] of one causal forward over all ids (row t predicts token t + 1).
  DVec forward(const std::vector<int32_t>& ids) const;

 private:
  DVec vec(const std::string& name, int64_t n) const {
    std::vector<float> f = ckpt_->get(name).to_f32();
    if (static_cast<int64_t>(f.size()) != n) throw std::runtime_error("reference: size of " + name);
    return DVec(f.begin(), f.end());
  }
  RefLinear lin(const std::string& prefix, int64_t n_out, int64_t n_in) const {
    std::vector<float> f = load_linear(*ckpt_, prefix, n_out, n_in).decode_all();
    return {n_out, n_in, DVec(f.begin(), f.end())};
  }
  RefMlp mlp(const std::string& prefix, int64_t inter) const {
    return {lin(prefix + ".gate_proj", inter, h_.hidden), lin(prefix + ".up_proj", inter, h_.hidden),
            lin(prefix + ".down_proj", h_.hidden, inter)};
  }
  void load_weights();
  void rmsnorm(DVec& x, const DVec& w, double eps) const;
  void rotate(double* x, int64_t pos) const;
  std::vector<DVec> attention(const RefLayer& L, const std::vector<DVec>& x) const;
  DVec moe(const RefLayer& L, const DVec& x) const;

  nlohmann::json config_;
  RefHparams h_;
  std::unique_ptr<Checkpoint> ckpt_;
  DVec embed_, final_norm_;
  RefLinear lm_head_;
  std::vector<RefLayer> layers_;
};

inline void DeepseekV3Reference::load_weights() {
  const int64_t H = h_.hidden, nh = h_.n_heads, qk = h_.nope + h_.rope;
  embed_ = vec("model.embed_tokens.weight", h_.vocab * H);
  final_norm_ = vec("model.norm.weight", H);
  lm_head_ = h_.tie_embeddings ? RefLinear{h_.vocab, H, embed_} : lin("lm_head", h_.vocab, H);
  for (int64_t l = 0; l < h_.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    RefLayer L;
    L.input_norm = vec(p + "input_layernorm.weight", H);
    L.post_norm = vec(p + "post_attention_layernorm.weight", H);
    if (h_.q_lora > 0) {
      L.q_a = lin(p + "self_attn.q_a_proj", h_.q_lora, H);
      L.q_a_norm = vec(p + "self_attn.q_a_layernorm.weight", h_.q_lora);
      L.q_b = lin(p + "self_attn.q_b_proj", nh * qk, h_.q_lora);
    } else {
      L.q = lin(p + "self_attn.q_proj", nh * qk, H);
    }
    L.kv_a = lin(p + "self_attn.kv_a_proj_with_mqa", h_.kv_lora + h_.rope, H);
    L.kv_a_norm = vec(p + "self_attn.kv_a_layernorm.weight", h_.kv_lora);
    L.kv_b = lin(p + "self_attn.kv_b_proj", nh * (h_.nope + h_.v_head), h_.kv_lora);
    L.o = lin(p + "self_attn.o_proj", H, nh * h_.v_head);
    L.moe = l >= h_.first_dense;  // transformers: MoE iff layer_idx >= first_k_dense_replace
    if (!L.moe) {
      L.dense = mlp(p + "mlp", h_.inter);
    } else {
      L.router = lin(p + "mlp.gate", h_.n_experts, H);
      L.router_bias = vec(p + "mlp.gate.e_score_correction_bias", h_.n_experts);
      for (int64_t e = 0; e < h_.n_experts; ++e)
        L.experts.push_back(mlp(p + "mlp.experts." + std::to_string(e), h_.moe_inter));
      if (h_.n_shared > 0) L.shared = mlp(p + "mlp.shared_experts", h_.moe_inter * h_.n_shared);
    }
    layers_.push_back(std::move(L));
  }
}

inline void DeepseekV3Reference::rmsnorm(DVec& x, const DVec& w, double eps) const {
  double ms = 0.0;
  for (double v : x) ms += v * v;
  const double r = 1.0 / std::sqrt(ms / static_cast<double>(x.size()) + eps);
  for (size_t i = 0; i < x.size(); ++i) x[i] = w[i] * (x[i] * r);
}

// transformers' RoPE on `rope` dims at x: with rope_interleave the dims are first de-interleaved
// ([x0, x2, ..., x1, x3, ...]), then rotate_half with cos/sin = cat(freqs, freqs) * attention_factor. The result stays
// in the de-interleaved order, which is harmless because q and k are permuted alike.
inline void DeepseekV3Reference::rotate(double* x, int64_t pos) const {
  const int64_t d = h_.rope, half = d / 2;
  DVec y(x, x + d);
  if (h_.rope_interleave) {
    for (int64_t i = 0; i < half; ++i) {
      y[i] = x[2 * i];
      y[i + half] = x[2 * i + 1];
    }
  }
  for (int64_t i = 0; i < d; ++i) {
    double angle = static_cast<double>(pos) * h_.inv_freq[i % half];
    double c = std::cos(angle) * h_.rope_attention_factor, s = std::sin(angle) * h_.rope_attention_factor;
    double rot = i < half ? -y[i + half] : y[i - half];
    x[i] = y[i] * c + rot * s;
  }
}

// Non-absorbed MLA: k_nope and v expanded per token with kv_b_proj; softmax over [k_nope | k_pe] of tokens <= t.
inline std::vector<DVec> DeepseekV3Reference::attention(const RefLayer& L, const std::vector<DVec>& x) const {
  const int64_t n = static_cast<int64_t>(x.size()), nh = h_.n_heads, qk = h_.nope + h_.rope, kvd = h_.nope + h_.v_head;
  std::vector<DVec> q(n), kv(n), k_pe(n);
  for (int64_t t = 0; t < n; ++t) {
    const DVec& xt = x[t];
    if (h_.q_lora > 0) {
      DVec cq = L.q_a(xt);
      rmsnorm(cq, L.q_a_norm, 1e-6);  // q_a_layernorm is built without eps: 1e-6
      q[t] = L.q_b(cq);
    } else {
      q[t] = L.q(xt);
    }
    DVec kva = L.kv_a(xt);  // [c_kv (kv_lora) | k_pe (rope)]
    DVec ckv(kva.begin(), kva.begin() + h_.kv_lora);
    k_pe[t].assign(kva.begin() + h_.kv_lora, kva.end());
    rmsnorm(ckv, L.kv_a_norm, 1e-6);
    kv[t] = L.kv_b(ckv);  // per head [k_nope (nope) | v (v_head)]
    for (int64_t hd = 0; hd < nh; ++hd) rotate(q[t].data() + hd * qk + h_.nope, t);
    rotate(k_pe[t].data(), t);
  }
  std::vector<DVec> out(n);
  for (int64_t t = 0; t < n; ++t) {
    DVec concat(nh * h_.v_head, 0.0);
    for (int64_t hd = 0; hd < nh; ++hd) {
      const double* qh = q[t].data() + hd * qk;
      DVec score(t + 1);
      for (int64_t s = 0; s <= t; ++s) {
        const double* kn = kv[s].data() + hd * kvd;
        double dot = 0.0;
        for (int64_t i = 0; i < h_.nope; ++i) dot += qh[i] * kn[i];
        for (int64_t i = 0; i < h_.rope; ++i) dot += qh[h_.nope + i] * k_pe[s][i];
        score[s] = dot * h_.softmax_scale;
      }
      const double mx = *std::max_element(score.begin(), score.end());
      double sum = 0.0;
      for (double& v : score) sum += (v = std::exp(v - mx));
      for (int64_t s = 0; s <= t; ++s) {
        const double* v = kv[s].data() + hd * kvd + h_.nope;
        for (int64_t i = 0; i < h_.v_head; ++i) concat[hd * h_.v_head + i] += score[s] / sum * v[i];
      }
    }
    out[t] = L.o(concat);
  }
  return out;
}

// sigmoid router; bias for selection only; groups scored by their top-2 sum, the rest masked with 0.0; top-k;
// weights from the unbiased scores, renormalised when norm_topk_prob, times routed_scaling_factor; plus shared experts.
inline DVec DeepseekV3Reference::moe(const RefLayer& L, const DVec& x) const {
  const int64_t E = h_.n_experts, per_group = E / h_.n_group;
  DVec logits = L.router(x), s(E), choice(E);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = 1.0 / (1.0 + std::exp(-logits[e]));
    choice[e] = s[e] + (h_.use_router_bias ? L.router_bias[e] : 0.0);
  }
  DVec group_score(h_.n_group);
  for (int64_t g = 0; g < h_.n_group; ++g) {
    DVec members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
    std::sort(members.rbegin(), members.rend());
    group_score[g] = members[0] + (per_group > 1 ? members[1] : 0.0);
  }
  std::vector<int64_t> groups(h_.n_group);
  std::iota(groups.begin(), groups.end(), 0);
  std::stable_sort(groups.begin(), groups.end(), [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
  for (int64_t r = h_.topk_group; r < h_.n_group; ++r) {
    int64_t g = groups[r];
    std::fill(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group, 0.0);
  }
  std::vector<int64_t> idx(E);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
  double sum = 0.0;
  for (int64_t k = 0; k < h_.top_k; ++k) sum += s[idx[k]];
  DVec y = h_.n_shared > 0 ? L.shared(x) : DVec(x.size(), 0.0);
  for (int64_t k = 0; k < h_.top_k; ++k) {
    int64_t e = idx[k];
    double w = s[e];
    if (h_.norm_topk) w /= (sum + 1e-20);
    w *= h_.routed_scaling;
    DVec ye = L.experts[e](x);
    for (size_t i = 0; i < y.size(); ++i) y[i] += w * ye[i];
  }
  return y;
}

inline DVec DeepseekV3Reference::forward(const std::vector<int32_t>& ids) const {
  const int64_t n = static_cast<int64_t>(ids.size()), H = h_.hidden;
  std::vector<DVec> h(n);
  for (int64_t t = 0; t < n; ++t) h[t].assign(embed_.begin() + ids[t] * H, embed_.begin() + (ids[t] + 1) * H);
  for (const RefLayer& L : layers_) {
    std::vector<DVec> x = h;
    for (auto& xt : x) rmsnorm(xt, L.input_norm, h_.rms_eps);
    std::vector<DVec> a = attention(L, x);
    for (int64_t t = 0; t < n; ++t) {
      DVec& ht = h[t];
      for (int64_t i = 0; i < H; ++i) ht[i] += a[t][i];
      DVec xt = ht;
      rmsnorm(xt, L.post_norm, h_.rms_eps);
      DVec y = L.moe ? moe(L, xt) : L.dense(xt);
      for (int64_t i = 0; i < H; ++i) ht[i] += y[i];
    }
  }
  DVec logits;
  for (int64_t t = 0; t < n; ++t) {
    DVec xt = h[t];
    rmsnorm(xt, final_norm_, h_.rms_eps);
    DVec row = lm_head_(xt);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

}  // namespace bg::testing

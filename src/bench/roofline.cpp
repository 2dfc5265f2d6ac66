// StepCostModel: weights enumerated from the architecture's table (so every linear the model reads is counted once,
// as stored), attention and state sizes from the config.
#include "bench/roofline.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "formats/kimi_k3_config.h"
#include "formats/model_config.h"
#include "model/deepseek_v3.h"
#include "model/kimi_k3.h"

namespace bg::bench {
namespace {

double stored_bytes(const QuantWeight& w) { return static_cast<double>(w.data.nbytes + w.scale.nbytes); }

bool is_lm_head(const TensorSpec& s) { return s.pattern.find("lm_head") != std::string::npos; }
bool is_embedding(const TensorSpec& s) { return s.pattern.find("embed_tokens") != std::string::npos; }

}  // namespace

void StepCost::add(double op_bytes, double op_flops, const Ceilings& c) {
  bytes += op_bytes;
  flops += op_flops;
  const double read_ms = c.memory_gbps() > 0 ? op_bytes / (c.memory_gbps() * 1e6) : 0.0;
  const double compute_ms = c.compute_tflops() > 0 ? op_flops / (c.compute_tflops() * 1e9) : 0.0;
  roofline_ms += std::max(read_ms, compute_ms);
}

StepCostModel StepCostModel::load(const std::filesystem::path& dir, int64_t act_bytes) {
  const auto config_path = dir / "config.json";
  const nlohmann::json config = read_json_file(config_path);
  StepCostModel m;
  m.act_bytes_ = act_bytes;
  ArchTable table;
  std::vector<bool> moe_layer;
  if (detect_arch(config, config_path.string()) == Arch::kKimiK3) {
    const KimiK3Config c = parse_kimi_k3_config(config, config_path.string());
    m.arch_ = "kimi_k3";
    table = kimi_k3_table(c);
    m.hidden_ = c.hidden_size;
    m.vocab_ = c.vocab_size;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      moe_layer.push_back(c.is_moe_layer(l));
      if (c.is_mla(l)) {
        m.mla_.push_back({c.n_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim});
      } else {
        m.kda_.push_back({c.kda_heads, c.kda_head_dim, c.kda_proj_dim(), c.conv_kernel});
      }
    }
    for (int64_t l = 0; l < c.n_layers; ++l) {
      if (c.is_moe_layer(l)) m.moe_.push_back({c.n_experts, c.n_experts_per_token, 0, 0, 0, 0});
    }
  } else {
    const DeepseekV3Config c = parse_deepseek_v3_config(config, config_path.string());
    m.arch_ = "deepseek_v3";
    table = deepseek_v3_table(c);
    m.hidden_ = c.hidden_size;
    m.vocab_ = c.vocab_size;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      moe_layer.push_back(c.is_moe_layer(l));
      m.mla_.push_back({c.n_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim});
      if (c.is_moe_layer(l)) m.moe_.push_back({c.n_routed_experts, c.n_experts_per_tok, 0, 0, 0, 0});
    }
  }
  const ModelWeights w = ModelWeights::bind(Checkpoint::open(dir), table);
  // Routed experts: one expert's bytes and elements per MoE layer (every expert of a layer has the same shapes).
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < static_cast<int64_t>(moe_layer.size()); ++l) {
    if (moe_layer[static_cast<size_t>(l)]) moe_layers.push_back(l);
  }
  bool tied = true;
  for (const TensorSpec& spec : table.specs) {
    if (spec.kind != TensorKind::kLinear) continue;
    if (spec.scope == Scope::kExpert) {
      for (size_t i = 0; i < moe_layers.size(); ++i) {
        if (spec.in_layer && !spec.in_layer(moe_layers[i])) continue;
        const QuantWeight& q = w.linear(spec.id, moe_layers[i], 0);
        Moe& moe = m.moe_[i];
        moe.expert_bytes += stored_bytes(q);
        moe.expert_params += static_cast<double>(q.n_out * q.n_in);
        // gate / up read the expert input width, down maps back to it: the widest n_in is that width.
        moe.in_dim = std::max(moe.in_dim, q.n_in);
        moe.out_dim = moe.in_dim;
      }
      continue;
    }
    const int64_t n_layers = spec.scope == Scope::kGlobal ? 1 : table.n_layers;
    for (int64_t l = 0; l < n_layers; ++l) {
      const int64_t layer = spec.scope == Scope::kGlobal ? -1 : l;
      if (spec.scope == Scope::kLayer && spec.in_layer && !spec.in_layer(l)) continue;
      if (!w.has(spec.id, layer)) continue;
      const QuantWeight& q = w.linear(spec.id, layer);
      const Linear lin{q.n_out, q.n_in, stored_bytes(q)};
      if (is_lm_head(spec)) {
        m.lm_head_ = lin;
        tied = false;
      } else {
        m.dense_.push_back(lin);
      }
    }
  }
  if (tied) {  // tie_word_embeddings: the lm_head reads the embedding table
    for (const TensorSpec& spec : table.specs) {
      if (!is_embedding(spec)) continue;
      const TensorView& e = w.tensor(spec.id);
      m.lm_head_ = {m.vocab_, m.hidden_, static_cast<double>(e.nbytes)};
    }
  }
  BG_CHECK(m.lm_head_.n_out > 0, "roofline: {} has neither an lm_head nor an embedding table", dir.string());
  return m;
}

double StepCostModel::linear_cost(const Linear& l, int64_t rows, const Ceilings& c, StepCost& cost) const {
  const double bytes = l.weight_bytes + static_cast<double>(rows * (l.n_in + l.n_out) * act_bytes_);
  const double flops = 2.0 * static_cast<double>(rows) * static_cast<double>(l.n_in * l.n_out);
  cost.add(bytes, flops, c);
  return bytes;
}

StepCost StepCostModel::decode_step(int64_t batch, int64_t context, std::span<const double> touched,
                                    const Ceilings& c) const {
  StepCost cost;
  const auto b = static_cast<double>(batch);
  cost.add(b * static_cast<double>(hidden_ * act_bytes_), 0.0, c);  // embedding rows
  for (const Linear& l : dense_) linear_cost(l, batch, c, cost);
  linear_cost(lm_head_, batch, c, cost);
  for (size_t i = 0; i < moe_.size(); ++i) {
    const Moe& m = moe_[i];
    const double experts = i < touched.size() ? touched[i] : static_cast<double>(m.n_experts);
    const double rows = b * static_cast<double>(m.top_k);
    cost.add(experts * m.expert_bytes + rows * static_cast<double>((m.in_dim + m.out_dim) * act_bytes_),
             2.0 * rows * m.expert_params, c);
  }
  // MLA (absorbed decode): every sequence reads its context + the new entry, [kv_lora | rope] per token.
  const double keys = static_cast<double>(context + 1);
  for (const Mla& a : mla_) {
    const double entry = static_cast<double>(a.kv_lora + a.rope);
    const double bytes = b * keys * entry * static_cast<double>(act_bytes_);
    // per head: q.k over kv_lora + rope, p.v over kv_lora; W_UK / W_UV absorption of q_nope and the output.
    const double per_head = 2.0 * keys * (entry + static_cast<double>(a.kv_lora)) +
                            2.0 * static_cast<double>((a.nope + a.v) * a.kv_lora);
    cost.add(bytes, b * static_cast<double>(a.heads) * per_head, c);
  }
  // KDA (recurrent): each sequence's [H, K, K] fp32 state read and written, its conv states (activation dtype)
  // likewise.
  for (const Kda& k : kda_) {
    const double state = static_cast<double>(k.heads * k.head_dim * k.head_dim) * 4.0;
    const double conv = static_cast<double>(3 * k.conv_channels * (k.conv_width - 1) * act_bytes_);
    cost.add(b * 2.0 * (state + conv), b * 8.0 * static_cast<double>(k.heads * k.head_dim * k.head_dim), c);
  }
  return cost;
}

StepCost StepCostModel::prefill_chunk(int64_t start, int64_t n, const Ceilings& c) const {
  StepCost cost;
  const auto rows = static_cast<double>(n);
  cost.add(rows * static_cast<double>(hidden_ * act_bytes_), 0.0, c);
  for (const Linear& l : dense_) linear_cost(l, n, c, cost);
  linear_cost(lm_head_, 1, c, cost);  // forward_batch computes the last row's logits only
  for (const Moe& m : moe_) {
    const double e = static_cast<double>(m.n_experts), k = static_cast<double>(m.top_k);
    // Expected experts with at least one of the chunk's n * k rows under uniform routing.
    const double touched = e * (1.0 - std::pow(1.0 - k / e, rows));
    const double slots = rows * k;
    cost.add(touched * m.expert_bytes + slots * static_cast<double>((m.in_dim + m.out_dim) * act_bytes_),
             2.0 * slots * m.expert_params, c);
  }
  // Causal attention of the chunk's queries (positions start .. start + n - 1) over keys 0 .. position.
  const double pairs = rows * static_cast<double>(start) + rows * (rows + 1.0) / 2.0;
  for (const Mla& a : mla_) {
    const double qk = static_cast<double>(a.nope + a.rope), v = static_cast<double>(a.v);
    const double kv_bytes = static_cast<double>((start + n) * (a.kv_lora + a.rope) * act_bytes_);
    cost.add(kv_bytes, 2.0 * static_cast<double>(a.heads) * (qk + v) * pairs, c);
  }
  // Chunked KDA: state in and out once per chunk; per token a few K x V state products plus 64-token intra-chunk
  // attention over K and V.
  for (const Kda& k : kda_) {
    const double kv = static_cast<double>(k.head_dim * k.head_dim), h = static_cast<double>(k.heads);
    const double state = h * kv * 4.0;
    cost.add(2.0 * state, rows * h * (8.0 * kv + 2.0 * 64.0 * 2.0 * static_cast<double>(k.head_dim)), c);
  }
  return cost;
}

}  // namespace bg::bench

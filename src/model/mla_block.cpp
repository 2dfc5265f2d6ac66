// MLA block on the CPU reference ops.
#include "model/mla_block.h"

#include <algorithm>
#include <cmath>

#include "ops/linear/linear.h"
#include "ops/mla/mla.h"
#include "ops/rmsnorm/rmsnorm.h"

namespace bg {
namespace {

// transformers builds q_a_layernorm / kv_a_layernorm without an eps argument: 1e-6, not rms_norm_eps (both archs).
constexpr float kLatentNormEps = 1e-6f;

}  // namespace

void MlaLayerWeights::set_kv_b(const QuantWeight& kv_b, const MlaDims& d) {
  const int64_t nope = d.qk_nope, vd = d.v_head, r = d.kv_lora_rank;
  std::vector<float> all = kv_b.decode_all();  // [n_heads * (nope + v), kv_lora]
  w_uk.resize(static_cast<size_t>(d.n_heads * nope * r));
  w_uv.resize(static_cast<size_t>(d.n_heads * vd * r));
  for (int64_t h = 0; h < d.n_heads; ++h) {
    const float* head = all.data() + h * (nope + vd) * r;
    std::copy(head, head + nope * r, w_uk.begin() + h * nope * r);
    std::copy(head + nope * r, head + (nope + vd) * r, w_uv.begin() + h * vd * r);
  }
}

void mla_block_forward(const MlaDims& d, const MlaLayerWeights& w, Sequence& seq, int64_t mla_layer, const float* x,
                       const std::vector<int64_t>& positions, float* out) {
  const int64_t n = static_cast<int64_t>(positions.size()), nh = d.n_heads;
  const int64_t qk = d.qk_nope + d.qk_rope, r = d.kv_lora_rank, entry = r + d.qk_rope;
  std::vector<float> q(static_cast<size_t>(n * nh * qk));  // [n, nh, nope + rope]
  if (d.q_lora_rank > 0) {
    std::vector<float> cq(static_cast<size_t>(n * d.q_lora_rank));  // [n, q_lora]
    ops::linear_cpu(*w.q_a, x, n, cq.data());
    ops::rmsnorm_cpu({n, d.q_lora_rank, kLatentNormEps}, cq.data(), w.q_a_norm.data(), cq.data());
    ops::linear_cpu(*w.q_b, cq.data(), n, q.data());
  } else {
    ops::linear_cpu(*w.q, x, n, q.data());
  }
  std::vector<float> kv(static_cast<size_t>(n * entry));  // [n, kv_lora + rope] = [c_kv | k_pe]
  ops::linear_cpu(*w.kv_a, x, n, kv.data());
  for (int64_t t = 0; t < n; ++t) {
    ops::rmsnorm_cpu({1, r, kLatentNormEps}, kv.data() + t * entry, w.kv_a_norm.data(), kv.data() + t * entry);
  }
  if (d.rope != nullptr && d.qk_rope > 0) {
    ops::apply_rope_cpu({n, nh, qk, nh * qk, d.qk_nope, d.qk_rope, d.rope_interleaved}, *d.rope, positions.data(),
                        q.data());
    ops::apply_rope_cpu({n, 1, entry, entry, r, d.qk_rope, d.rope_interleaved}, *d.rope, positions.data(), kv.data());
  }
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(kv.data() + t * entry, entry, seq.kv_entry(mla_layer, positions[static_cast<size_t>(t)]));
  }
  std::vector<const float*> blocks = seq.kv_block_ptrs(mla_layer);
  std::vector<float> attn(static_cast<size_t>(n * nh * d.v_head));  // [n, nh, v]
  ops::MlaParams p{n, nh, r, d.qk_nope, d.qk_rope, d.v_head, seq.kv_block_size(), d.softmax_scale};
  ops::mla_attention_cpu(p, q.data(), w.w_uk.data(), w.w_uv.data(), blocks.data(), positions.data(), attn.data());
  if (w.gate != nullptr) {
    std::vector<float> g(attn.size());  // [n, nh * v]
    ops::linear_cpu(*w.gate, x, n, g.data());
    for (size_t i = 0; i < attn.size(); ++i) attn[i] *= 1.0f / (1.0f + std::exp(-g[i]));
  }
  ops::linear_cpu(*w.o, attn.data(), n, out);
}

}  // namespace bg

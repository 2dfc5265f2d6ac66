// MLA block over the backend ops.
#include "model/mla_block.h"

#include <algorithm>

#include "core/error.h"
#include "model/forward_common.h"

namespace bg {
namespace {

// transformers builds q_a_layernorm / kv_a_layernorm without an eps argument: 1e-6, not rms_norm_eps (both archs).
constexpr float kLatentNormEps = 1e-6f;

}  // namespace

void MlaLayerWeights::set_kv_b(Backend& be, const QuantWeight& kv_b, const MlaDims& d, int64_t first_head) {
  const int64_t nope = d.qk_nope, vd = d.v_head, r = d.kv_lora_rank;
  BG_CHECK(first_head >= 0 && (first_head + d.n_heads) * (nope + vd) <= kv_b.n_out && kv_b.n_in == r,
           "'{}': [{}, {}] has no heads [{}, {}) of {} + {} rows", kv_b.name, kv_b.n_out, kv_b.n_in, first_head,
           first_head + d.n_heads, nope, vd);
  std::vector<float> all = kv_b.decode_all();  // [n_heads_total * (nope + v), kv_lora]
  std::vector<float> uk(static_cast<size_t>(d.n_heads * nope * r)), uv(static_cast<size_t>(d.n_heads * vd * r));
  for (int64_t h = 0; h < d.n_heads; ++h) {
    const float* head = all.data() + (first_head + h) * (nope + vd) * r;
    std::copy(head, head + nope * r, uk.begin() + h * nope * r);
    std::copy(head + nope * r, head + (nope + vd) * r, uv.begin() + h * vd * r);
  }
  w_uk = be.upload_f32(uk, {d.n_heads, nope, r}, be.act_dtype());
  w_uv = be.upload_f32(uv, {d.n_heads, vd, r}, be.act_dtype());
}

void mla_block_forward(Backend& be, const MlaDims& d, const MlaLayerWeights& w, const MlaCacheRef& cache,
                       const Tensor& x, Tensor& out) {
  const int64_t n = x.rows(), nh = d.n_heads;
  const int64_t qk = d.qk_nope + d.qk_rope, r = d.kv_lora_rank, entry = r + d.qk_rope;
  BG_CHECK(w.in.parts.size() == (w.gate ? 3u : 2u), "internal: MLA input group of {} linears", w.in.parts.size());
  const GroupProjections in(be, w.in, x);  // q_a (or q), kv_a, gate
  Tensor q;                                // [n, nh, nope + rope]
  if (d.q_lora_rank > 0) {
    Tensor cq = in[0];  // [n, q_lora]
    be.rmsnorm(cq, w.q_a_norm, kLatentNormEps, cq);
    q = be.act(n, nh * qk);
    be.linear(*w.q_b, cq, q);
  } else {
    q = in[0];
  }
  Tensor kv = in[1];  // [n, kv_lora + rope] = [c_kv | k_pe]; only c_kv is normed
  if (d.rope != nullptr && d.qk_rope > 0) {
    be.rmsnorm(kv, w.kv_a_norm, kLatentNormEps, kv);
    be.rope({n, nh, qk, nh * qk, d.qk_nope, d.qk_rope, d.rope_interleaved}, *d.rope, q);
    be.rope({n, 1, entry, entry, r, d.qk_rope, d.rope_interleaved}, *d.rope, kv);
    be.mla_write(cache, kv);
  } else {
    be.mla_write_normed(cache, kv, w.kv_a_norm, kLatentNormEps);  // k_pe as it is: norm and write in one op
  }
  Tensor attn = be.act(n, nh * d.v_head);  // [n, nh, v]
  ops::MlaParams p{n, nh, r, d.qk_nope, d.qk_rope, d.v_head, cache.block_size, d.softmax_scale};
  be.mla_attention(p, q, w.w_uk, w.w_uv, cache, attn);
  if (w.gate) be.sigmoid_mul(attn, in[2]);
  be.linear(*w.o, attn, out);
}

}  // namespace bg

// MLA absorbed attention, CPU reference: q_nope is projected into the latent (W_UK^T q), scores are taken against the
// cached latents, the softmax-weighted latent sum is projected out by W_UV. Softmax in fp32 with max subtraction.
#include "ops/mla/mla.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"

namespace bg::ops {

void mla_attention_cpu(const MlaParams& p, const float* q, const float* w_uk, const float* w_uv,
                       const float* const* blocks, const int64_t* positions, float* out) {
  BG_CHECK(p.n_heads > 0 && p.kv_lora_rank > 0 && p.block_size > 0, "mla: bad params (heads {}, kv_lora {}, block {})",
           p.n_heads, p.kv_lora_rank, p.block_size);
  const int64_t qk_dim = p.qk_nope_dim + p.qk_rope_dim;
  const int64_t entry_dim = p.kv_lora_rank + p.qk_rope_dim;
  parallel_for(p.n_tokens * p.n_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_lat(static_cast<size_t>(p.kv_lora_rank));
    std::vector<float> o_lat(static_cast<size_t>(p.kv_lora_rank));
    std::vector<float> scores;
    for (int64_t th = begin; th < end; ++th) {
      int64_t t = th / p.n_heads, h = th % p.n_heads;
      const float* qh = q + (t * p.n_heads + h) * qk_dim;
      const float* uk = w_uk + h * p.qk_nope_dim * p.kv_lora_rank;
      // q_lat[c] = sum_i q_nope[i] * W_UK[h][i][c]   [kv_lora]
      std::fill(q_lat.begin(), q_lat.end(), 0.0f);
      for (int64_t i = 0; i < p.qk_nope_dim; ++i) {
        float qi = qh[i];
        const float* row = uk + i * p.kv_lora_rank;
        for (int64_t c = 0; c < p.kv_lora_rank; ++c) q_lat[static_cast<size_t>(c)] += qi * row[c];
      }
      int64_t n_ctx = positions[t] + 1;
      scores.resize(static_cast<size_t>(n_ctx));
      float max_score = -INFINITY;
      for (int64_t j = 0; j < n_ctx; ++j) {
        const float* e = blocks[j / p.block_size] + (j % p.block_size) * entry_dim;
        float s = 0.0f;
        for (int64_t c = 0; c < p.kv_lora_rank; ++c) s += q_lat[static_cast<size_t>(c)] * e[c];
        for (int64_t r = 0; r < p.qk_rope_dim; ++r) s += qh[p.qk_nope_dim + r] * e[p.kv_lora_rank + r];
        s *= p.softmax_scale;
        scores[static_cast<size_t>(j)] = s;
        max_score = std::max(max_score, s);
      }
      float denom = 0.0f;
      for (auto& s : scores) {
        s = std::exp(s - max_score);
        denom += s;
      }
      std::fill(o_lat.begin(), o_lat.end(), 0.0f);
      for (int64_t j = 0; j < n_ctx; ++j) {
        const float* e = blocks[j / p.block_size] + (j % p.block_size) * entry_dim;
        float w = scores[static_cast<size_t>(j)] / denom;
        for (int64_t c = 0; c < p.kv_lora_rank; ++c) o_lat[static_cast<size_t>(c)] += w * e[c];
      }
      // out[v] = sum_c W_UV[h][v][c] * o_lat[c]   [v_head]
      const float* uv = w_uv + h * p.v_head_dim * p.kv_lora_rank;
      float* oh = out + (t * p.n_heads + h) * p.v_head_dim;
      for (int64_t v = 0; v < p.v_head_dim; ++v) {
        float s = 0.0f;
        const float* row = uv + v * p.kv_lora_rank;
        for (int64_t c = 0; c < p.kv_lora_rank; ++c) s += row[c] * o_lat[static_cast<size_t>(c)];
        oh[v] = s;
      }
    }
  });
}

}  // namespace bg::ops

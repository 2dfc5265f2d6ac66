// MLA attention in the absorbed form over a paged latent cache: each cached token holds [c_kv (kv_lora) | k_pe (rope)]
// (576 values for DeepSeek-V3 / Kimi). Used for prefill and decode alike, so a prompt split into pieces computes
// exactly what one prefill computes.
#pragma once

#include <cstdint>

namespace bg::ops {

struct MlaParams {
  int64_t n_tokens = 0;
  int64_t n_heads = 0;
  int64_t kv_lora_rank = 0;  // 512
  int64_t qk_nope_dim = 0;   // 128
  int64_t qk_rope_dim = 0;   // 64 (K3: the un-rotated "pe" part)
  int64_t v_head_dim = 0;    // 128
  int64_t block_size = 0;    // tokens per cache block
  float softmax_scale = 0.0f;
};

// q:      [n_tokens, n_heads, qk_nope + qk_rope] (rope part already rotated where the model rotates)
// w_uk:   [n_heads, qk_nope, kv_lora]  (the k_nope rows of kv_b_proj, per head)
// w_uv:   [n_heads, v_head,  kv_lora]  (the v rows of kv_b_proj, per head)
// blocks: blocks[b] -> [block_size, kv_lora + qk_rope] for this layer; cache position p lives in block p / block_size
// positions: [n_tokens]; token t attends to cache positions 0..positions[t] (causal), which must be written already.
// out:    [n_tokens, n_heads, v_head]
void mla_attention_cpu(const MlaParams& p, const float* q, const float* w_uk, const float* w_uv,
                       const float* const* blocks, const int64_t* positions, float* out);

}  // namespace bg::ops

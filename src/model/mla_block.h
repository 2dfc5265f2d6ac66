// The MLA attention block shared by DeepSeek-V3 (YaRN RoPE) and Kimi-K3 (NoPE + output gate): q (LoRA or plain),
// the latent [c_kv | k_pe] written to the paged cache, absorbed attention, optional sigmoid output gate, o_proj.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "kv/sequence.h"

namespace bg {

struct MlaDims {
  int64_t n_heads = 0;  // heads this rank computes (all, or its tensor-parallel range)
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope = 0;
  int64_t qk_rope = 0;
  int64_t v_head = 0;
  float softmax_scale = 0.0f;
  const RopeHandle* rope = nullptr;  // null: the pe part is not rotated (Kimi-K3)
  bool rope_interleaved = true;
};

// One layer's MLA weights, prepared for a backend.
struct MlaLayerWeights {
  // q_a/q_b or q; gate optional (Kimi-K3). Owned by the model's BackendLinears.
  const LinearHandle* q_a = nullptr;
  const LinearHandle* q_b = nullptr;
  const LinearHandle* q = nullptr;
  const LinearHandle* kv_a = nullptr;
  const LinearHandle* o = nullptr;
  const LinearHandle* gate = nullptr;
  // What projects the block's input x: q_a (or q), kv_a, then gate where there is one (BackendLinears::group; fused
  // into one product at decode where the backend can).
  LinearGroup in;
  Tensor q_a_norm, kv_a_norm;                                // F32
  Tensor w_uk;  // [n_heads, qk_nope, kv_lora] (act dtype)
  Tensor w_uv;  // [n_heads, v_head, kv_lora]

  // Splits kv_b_proj [n_heads_total * (nope + v), kv_lora] per head into w_uk / w_uv for the d.n_heads heads from
  // first_head (tensor parallelism: this rank's head range).
  void set_kv_b(Backend& be, const QuantWeight& kv_b, const MlaDims& d, int64_t first_head = 0);
};

// x: [n_tokens, hidden] (normed input) of the backend's current step; writes out [n_tokens, hidden]. `cache` is this
// layer's view of the pool (the latent is shared by all heads, so every TP rank keeps the whole cache). With tensor
// parallelism q/gate hold this rank's heads and o_proj its input columns: `out` is a partial sum the caller
// all-reduces.
void mla_block_forward(Backend& be, const MlaDims& d, const MlaLayerWeights& w, const MlaCacheRef& cache,
                       const Tensor& x, Tensor& out);

}  // namespace bg

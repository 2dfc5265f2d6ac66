// The MLA attention block shared by DeepSeek-V3 (YaRN RoPE) and Kimi-K3 (NoPE + output gate): q (LoRA or plain),
// the 576-value latent [c_kv | k_pe] written to the paged cache, absorbed attention, optional sigmoid output gate,
// o_proj.
#pragma once

#include <cstdint>
#include <vector>

#include "formats/quant.h"
#include "kv/sequence.h"
#include "ops/rope/rope.h"

namespace bg {

struct MlaDims {
  int64_t n_heads = 0;
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0;
  int64_t qk_nope = 0;
  int64_t qk_rope = 0;
  int64_t v_head = 0;
  float softmax_scale = 0.0f;
  const ops::RopeTable* rope = nullptr;  // null: the pe part is not rotated (Kimi-K3)
  bool rope_interleaved = true;
};

// One layer's MLA weights. Linear pointers refer to ModelWeights; kv_b_proj is split per head at load.
struct MlaLayerWeights {
  const QuantWeight* q_a = nullptr;
  const QuantWeight* q_b = nullptr;
  const QuantWeight* q = nullptr;  // without q-LoRA
  const QuantWeight* kv_a = nullptr;
  const QuantWeight* o = nullptr;
  const QuantWeight* gate = nullptr;  // output gate (Kimi-K3), or null
  std::vector<float> q_a_norm, kv_a_norm;
  std::vector<float> w_uk;  // [n_heads, qk_nope, kv_lora]
  std::vector<float> w_uv;  // [n_heads, v_head, kv_lora]

  // Splits kv_b_proj [n_heads * (nope + v), kv_lora] into w_uk / w_uv.
  void set_kv_b(const QuantWeight& kv_b, const MlaDims& d);
};

// x: [n, hidden] (normed input), positions: [n]; writes out [n, hidden]. `mla_layer` indexes the sequence's cache.
void mla_block_forward(const MlaDims& d, const MlaLayerWeights& w, Sequence& seq, int64_t mla_layer, const float* x,
                       const std::vector<int64_t>& positions, float* out);

}  // namespace bg

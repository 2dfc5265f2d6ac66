// Attention-Residual mix (Kimi-K3 block AttnRes): a per-token softmax-weighted sum of candidate residual vectors.
#pragma once

#include <cstdint>

namespace bg::ops {

struct AttnResParams {
  int64_t n_candidates = 0;  // n: banked block entries + the current partial sum (1 .. 9 in K3)
  int64_t n_tokens = 0;      // T, may be 0
  int64_t dim = 0;           // D (hidden_size)
  float eps = 1e-5f;         // inside the rsqrt of the score norm
};

// Per token t: s_i = sum_d (V_i[t,d] * rsqrt(mean_d(V_i[t,:]^2) + eps)) * norm[d] * proj[d];
// alpha = softmax_i(s); out[t,:] = sum_i alpha_i V_i[t,:] (the RAW candidates, not the normalised ones).
//   values  n_candidates pointers, each [T, D] (packed [n, T, D] storage: pass &packed[i*T*D])
//   norm    [D]  *_res_norm.weight
//   proj    [D]  *_res_proj.weight ([1, D])
//   out     [T, D]; may be one of the candidates (each output element is written after its inputs are read).
void attn_res_mix_cpu(const AttnResParams& p, const float* const* values, const float* norm, const float* proj,
                      float* out);

}  // namespace bg::ops

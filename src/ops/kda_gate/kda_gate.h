// KDA per-token pre-processing: the lower-bound forget gate (log decay), per-head L2 normalisation of q/k, and beta.
#pragma once

#include <cstdint>

namespace bg::ops {

struct KdaGateParams {
  int64_t n_tokens = 0;       // T, may be 0
  int64_t n_heads = 0;        // H
  int64_t head_dim = 0;       // K
  float lower_bound = -5.0f;  // linear_attn_config.gate_lower_bound; must be < 0
};

// fla's lower-bound gate (safe_gate): g[t,h,d] = lower_bound * sigmoid(exp(A_log[h]) * (g_raw[t,h*K+d] +
// dt_bias[h*K+d])), a log decay in (lower_bound, 0).
//   g_raw   [T, H*K]  f_b_proj(f_a_proj(x))
//   a_log   [H]       only the first H entries are read (the K3 checkpoint stores [K], zero beyond H)
//   dt_bias [H*K]
//   g       [T, H, K] may alias g_raw
void kda_gate_cpu(const KdaGateParams& p, const float* g_raw, const float* a_log, const float* dt_bias, float* g);

struct KdaL2NormParams {
  int64_t n_rows = 0;  // tokens x heads, may be 0
  int64_t dim = 0;     // head_dim
  float scale = 1.0f;  // extra factor (head_dim^-0.5 for q, 1 for k)
  float eps = 1e-6f;   // inside the sqrt, as fla's l2norm
};

// out[r,:] = scale * x[r,:] / sqrt(sum_d x[r,d]^2 + eps). x, out: [n_rows, dim] (may alias).
void kda_l2norm_cpu(const KdaL2NormParams& p, const float* x, float* out);

// beta[i] = sigmoid(b[i]) for n = T*H values of b_proj(x). b and beta may alias.
void kda_beta_cpu(int64_t n, const float* b, float* beta);

}  // namespace bg::ops

// KDA (Kimi Delta Attention) core: the per-channel gated delta rule over one sequence, in its recurrent form
// (decode, and the reference) and its chunked WY/UT form (prefill, as fla chunk_kda). Both leave the same state.
#pragma once

#include <cstdint>

namespace bg::ops {

// Shapes of one KDA call over ONE sequence (a batch is one call per sequence, each with its own state).
struct KdaParams {
  int64_t n_tokens = 0;    // T, may be 0 (then nothing is read or written)
  int64_t n_heads = 0;     // H
  int64_t head_dim_k = 0;  // K (key / query / decay channels)
  int64_t head_dim_v = 0;  // V (value channels)
};

inline constexpr int64_t kKdaDefaultChunkSize = 64;

// Per token t and head h, with the head's state S [K, V] (S[k][v]):
//   S <- diag(exp(g_t)) S;  u = v_t - S^T k_t;  S <- S + beta_t k_t u^T;  o_t = S^T q_t.
// Inputs (fp32, token-major, head-major inside a token):
//   q, k  [T, H, K]  already L2-normalised; q already scaled by K^-0.5 (this op normalises nothing)
//   v     [T, H, V]
//   g     [T, H, K]  per-channel log decay (<= 0; K3 keeps it in [-5, 0))
//   beta  [T, H]     in (0, 1)
// state [H, K, V] fp32, read and updated in place (K-first; HF stores it V-first, [H, V, K]).
// out   [T, H, V]. out must not alias the inputs or the state.
void kda_recurrent_cpu(const KdaParams& p, const float* q, const float* k, const float* v, const float* g,
                       const float* beta, float* state, float* out);

// Same contract as kda_recurrent_cpu, computed chunk by chunk (chunk_size tokens; T need not be a multiple).
// Within a chunk every decay factor is exp(G_i - G_j) with i >= j of the chunk's cumulative log decays G, so no
// factor exceeds 1 (never exp(G_i) * exp(-G_j), which overflows once G reaches -100 or so). Agrees with the
// recurrent form to fp32 rounding, and splitting a sequence across calls at any token gives the same result.
void kda_chunked_cpu(const KdaParams& p, const float* q, const float* k, const float* v, const float* g,
                     const float* beta, float* state, float* out, int64_t chunk_size = kKdaDefaultChunkSize);

}  // namespace bg::ops

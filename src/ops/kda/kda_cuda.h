// KDA (gated delta rule) on the GPU: the batch-shaped recurrent decode step (one token of each of many sequences,
// each with its own state slot) and the chunked prefill of one sequence. Same math and state layout as kda_cpu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/kda/kda.h"

namespace bg::ops {

// Per-token inputs, device pointers, token-major and head-major inside a token (as kda.h):
struct KdaCudaInputs {
  const __nv_bfloat16* q = nullptr;  // [n, H, K] L2-normalised, scaled by K^-0.5
  const __nv_bfloat16* k = nullptr;  // [n, H, K] L2-normalised
  const __nv_bfloat16* v = nullptr;  // [n, H, V]
  const float* g = nullptr;          // [n, H, K] per-channel log decay (<= 0)
  const float* beta = nullptr;       // [n, H]
};

// States of a batch of sequences: token t uses the fp32 state [H, K, V] (dense, the real K and V) at
// base + slot_idx[t] * slot_stride.
struct KdaStateSlots {
  float* base = nullptr;              // this KDA layer's state of slot 0
  const int32_t* slot_idx = nullptr;  // [n] device; distinct per token (two tokens of one sequence would race)
  int64_t slot_stride = 0;            // floats from one slot's state to the next (>= H * K * V)
};

// Head dims: head_dim_k and head_dim_v each in [1, 128], independently (K != V is fine); larger is a bg::Error.
// K == V == 128 (Kimi-K3 / Kimi-Linear) is the production path; smaller dims (test checkpoints) run the same kernels
// zero-padded to 128 with the real dims at run time.
inline constexpr int64_t kKdaCudaHeadDim = 128;     // the production head dim (the unpadded fast path)
inline constexpr int64_t kKdaCudaMaxHeadDim = 128;  // the largest head_dim_k / head_dim_v taken

// One recurrent step for p.n_tokens tokens of as many different sequences: per token t and head h,
//   S <- diag(exp(g)) S;  u = v - S^T k;  S <- S + beta k u^T;  o = S^T q   (S = the token's slot state, in place)
// out [n, H, V] bf16.
void kda_recurrent_cuda(const KdaParams& p, const KdaCudaInputs& in, const KdaStateSlots& states, __nv_bfloat16* out,
                        cudaStream_t stream);

// Chunked prefill (chunk 64, UT transform, exp(G_i - G_j) only) of p.n_tokens tokens of ONE sequence, continuing
// from and updating state [H, K, V] fp32 in place; equal to p.n_tokens recurrent steps to fp32 rounding.
// out [n, H, V] bf16. One CTA per head runs the chunks in order.
void kda_chunked_cuda(const KdaParams& p, const KdaCudaInputs& in, float* state, __nv_bfloat16* out,
                      cudaStream_t stream);

}  // namespace bg::ops

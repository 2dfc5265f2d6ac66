// KDA (gated delta rule) on the GPU: the batch-shaped recurrent decode step (one token of each of many sequences,
// each with its own state slot), the chunked prefill of one sequence and of every chunked sequence of a step.
// Same math and state layout as kda_cpu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
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
  // kda_recurrent_cuda only: when set, tokens t >= *live_tokens (device, read by the kernel: a captured graph's
  // replays each see their step's count) are padding rows: output zero, their slot's state neither read nor written.
  // A negative slot index is treated the same way by kda_recurrent_cuda.
  const int32_t* live_tokens = nullptr;
};

// Head dims: head_dim_k and head_dim_v each in [1, 128], independently (K != V is fine); larger is a bg::Error.
// K == V == 128 (Kimi-K3 / Kimi-Linear) is the production path; smaller dims (test checkpoints) run the same kernels
// zero-padded to 128 with the real dims at run time.
inline constexpr int64_t kKdaCudaHeadDim = 128;     // the production head dim (the unpadded fast path)
inline constexpr int64_t kKdaCudaMaxHeadDim = 128;  // the largest head_dim_k / head_dim_v taken

// One recurrent step for p.n_tokens tokens of as many different sequences: per token t and head h,
//   S <- diag(exp(g)) S;  u = v - S^T k;  S <- S + beta k u^T;  o = S^T q   (S = the token's slot state, in place)
// out [n, H, V] bf16.
// `splits`: 0 picks kda_recurrent_splits; 1 or 4 forces a column split of the full-dims path (tests).
void kda_recurrent_cuda(const KdaParams& p, const KdaCudaInputs& in, const KdaStateSlots& states, __nv_bfloat16* out,
                        cudaStream_t stream, int splits = 0);

// How many CTAs split one (token, head) of kda_recurrent_cuda's full-dims path over the state's columns, from
// BG_KDA_RECURRENT_SPLIT (read once): unset or "auto" (the default since 2026-12-05, measured on the H200: 5.8 against
// 6.1 us at one K3 token, the same from 16 on), 4 when the step has at most kKdaRecurrentSplitBelow (token, head)
// pairs, else 1; "1", 1 CTA (all 128 columns); "4", 4 CTAs of 32 columns. Anything else throws. The results are
// bit-identical either way.
inline constexpr int64_t kKdaRecurrentSplitBelow = 512;
int kda_recurrent_splits(int64_t token_heads);
int kda_recurrent_splits(int64_t token_heads, const char* env_value);
// CTAs of the full-dims recurrent kernel that fit on one SM of the current device (cudaOccupancy...; 2 on the H200 at
// 64 registers a thread, 4 with the column split). A test holds it there: one CTA per SM cost 37 % at batch 64.
int kda_recurrent_ctas_per_sm(int splits);

// Scratch of the tensor-core chunked path (chunk-local operands of every (chunk, head), ~120 KB each), passed in so
// that the launchers allocate nothing (CUDA-graph capturable). 16-byte aligned.
struct KdaWorkspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Chunks of 64 tokens of one sequence of n_tokens.
int64_t kda_chunk_count(int64_t n_tokens);
// Workspace bytes for n_chunks chunks at p's heads and dims: 0 unless K == V == 128 (the other dims take the
// CUDA-core kernel, which needs none).
size_t kda_chunked_workspace_bytes(const KdaParams& p, int64_t n_chunks);

// Chunked prefill (chunk 64, UT transform, exp(G_i - G_j) only) of p.n_tokens tokens of ONE sequence, continuing
// from and updating state [H, K, V] fp32 in place; equal to p.n_tokens recurrent steps to fp32 rounding.
// out [n, H, V] bf16. K == V == 128: the tensor-core kernels (kda_chunked_tc.cu; workspace of
// kda_chunked_workspace_bytes(p, kda_chunk_count(n)) bytes); other dims: kda_chunked_simt_cuda (ws unused).
void kda_chunked_cuda(const KdaParams& p, const KdaCudaInputs& in, float* state, __nv_bfloat16* out, KdaWorkspace ws,
                      cudaStream_t stream);

// The CUDA-core chunked kernel (any K, V in [1, 128]; one CTA per head runs the chunks in order, fp32 throughout):
// the path for head dims other than 128, kept callable for tests.
void kda_chunked_simt_cuda(const KdaParams& p, const KdaCudaInputs& in, float* state, __nv_bfloat16* out,
                           cudaStream_t stream);

struct KdaVarlenPlan;  // kda_varlen_plan.h

// Every chunked sequence of a step in one launch pair: the plan's sequences (token rows of in / out as the step lays
// them out, p.n_tokens rows in all), each continuing its own state at state_base + slot * slot_stride.
struct KdaVarlenBatch {
  const KdaVarlenPlan* plan = nullptr;  // host plan: counts, and the offsets of the fallback's per-sequence launches
  const int32_t* plan_dev = nullptr;    // plan->packed() on the device (read by the tensor-core kernels)
  float* state_base = nullptr;          // this KDA layer's state of slot 0
  int64_t slot_stride = 0;              // floats from one slot's state to the next (>= H * K * V)
};
// Workspace: kda_chunked_workspace_bytes(p, plan->n_chunks()). Dims other than 128: one kda_chunked_simt_cuda launch
// per sequence (plan_dev and ws unused).
void kda_chunked_varlen_cuda(const KdaParams& p, const KdaCudaInputs& in, const KdaVarlenBatch& batch,
                             __nv_bfloat16* out, KdaWorkspace ws, cudaStream_t stream);

}  // namespace bg::ops

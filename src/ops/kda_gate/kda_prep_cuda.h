// CUDA KDA preparation of a decode step in one launch: the q / k / v short conv + SiLU (conv states updated), the
// per-head q / k L2 norm, the forget gate and beta. Each value is computed with the same arithmetic, in the same
// order, as the separate kernels (short_conv_decode_cuda, kda_l2norm_cuda, kda_gate_cuda, kda_beta_cuda), so the
// results are bit for bit theirs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/short_conv/short_conv_cuda.h"

namespace bg::ops {

inline constexpr int64_t kKdaPrepMaxHeadDim = 256;
inline constexpr int64_t kKdaPrepMaxConv = 4;  // conv widths past this run the separate kernels

struct KdaPrepDecodeParams {
  int64_t n_seqs = 0;       // one token each
  int64_t n_heads = 0;      // H
  int64_t head_dim = 0;     // K, at most kKdaPrepMaxHeadDim
  int64_t kernel_size = 4;  // W of the short conv, at most kKdaPrepMaxConv
  float q_scale = 1.0f;     // K^-0.5
  float l2_eps = 1e-6f;     // inside the sqrt (fla's l2norm)
  float lower_bound = -5.0f;
};

struct KdaPrepDecodeInputs {
  const __nv_bfloat16* x[3] = {};  // q, k, v projections [n_seqs, H*K], row stride x_row[i] elements
  int64_t x_row[3] = {};
  const float* conv_weight[3] = {};  // [H*K, W]
  ConvStateSlots conv_state[3];      // slot s of sequence s: [H*K, W-1] bf16, oldest first; slot < 0: padding
  const __nv_bfloat16* g_raw = nullptr;  // [n_seqs, H*K], row stride g_row
  int64_t g_row = 0;
  const float* a_log = nullptr;    // [>= H]
  const float* dt_bias = nullptr;  // [H*K]
  const __nv_bfloat16* b = nullptr;  // [n_seqs, H], row stride b_row
  int64_t b_row = 0;
};

struct KdaPrepDecodeOutputs {
  __nv_bfloat16 *q = nullptr, *k = nullptr, *v = nullptr;  // [n_seqs, H*K]
  float* g = nullptr;                                      // [n_seqs, H, K]
  float* beta = nullptr;                                   // [n_seqs, H]
};

// One CTA of four warps per (sequence, head): q, k, v (conv, SiLU, then q / k normalised) and gate + beta. Padding
// sequences (slot < 0, or past the conv states' live_tokens) leave their states alone and get zero q / k / v.
void kda_prep_decode_cuda(const KdaPrepDecodeParams& p, const KdaPrepDecodeInputs& in, const KdaPrepDecodeOutputs& out,
                          cudaStream_t stream);

// Whether K3's shape (head dim 128, conv width 4, aligned) runs the conv on four consecutive channels per lane with
// 8-byte loads and stores of its bf16 state (the same bits): on unless BG_KDA_PREP_W4X128=0 (read once).
bool kda_prep_w4x128_enabled();

}  // namespace bg::ops

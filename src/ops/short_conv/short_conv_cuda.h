// CUDA causal depthwise short conv + SiLU (KDA's q/k/v conv): bf16 activations, fp32 weight, bf16 conv state carried
// across calls. The state only ever holds past inputs, which are bf16, so bf16 storage is exact (half the bytes of
// fp32, the same outputs). A prefill call covers one sequence; the decode call covers many sequences of one token each.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/short_conv/short_conv.h"

namespace bg::ops {

// One sequence, T tokens: the contract of short_conv_cpu. x [T, C] bf16, weight [C, W] fp32, state [C, W-1] bf16
// (in/out, oldest first; may be null when W == 1), out [T, C] bf16 (must not alias x).
// Widths up to 4 with C a multiple of 8 and 16-byte aligned x / out take a vectorised kernel (8 channels by 16
// tokens per thread): by default the tiled one (64-token by 256-channel tiles staged in shared memory), or with
// BG_SHORT_CONV=rows the one reading rows straight from global memory; BG_SHORT_CONV=scalar forces the per-element
// kernel. All three give the same bits (the choice is for comparisons).
void short_conv_cuda(const ShortConvParams& p, const __nv_bfloat16* x, const float* weight, __nv_bfloat16* state,
                     __nv_bfloat16* out, cudaStream_t stream);
// KDA's q / k L2 norm over heads of head_dim channels (kda_l2norm_cuda's: x * scale / sqrt(sum x^2 + eps)).
struct ShortConvNorm {
  int64_t head_dim = 0;
  float scale = 1.0f;
  float eps = 1e-6f;
};

// short_conv_cuda, then the per-head L2 norm of its output, with the result bit for bit those two calls': where the
// tiled kernel runs and head_dim is a multiple of 32 dividing 256 (K3: 128), in one launch that keeps the conv's
// output in shared memory (the norm reads no copy of it from memory); otherwise as the two calls. C must be a
// multiple of head_dim.
void short_conv_l2norm_cuda(const ShortConvParams& p, const ShortConvNorm& norm, const __nv_bfloat16* x,
                            const float* weight, __nv_bfloat16* state, __nv_bfloat16* out, cudaStream_t stream);
enum class ShortConvKernel { kTiled, kRows, kScalar };
// BG_SHORT_CONV (tiled, rows or scalar; unset: tiled); anything else throws.
ShortConvKernel short_conv_kernel_from_env();

struct ShortConvDecodeParams {
  int64_t n_seqs = 0;       // sequences, one token each; may be 0
  int64_t n_channels = 0;   // C
  int64_t kernel_size = 4;  // W
};

// Where each sequence's conv state lives: state of sequence s = base + slot_idx[s] * slot_stride, [C, W-1] bf16.
// Slots of one call must be distinct; a negative slot index skips the sequence (its out row is left untouched).
struct ConvStateSlots {
  __nv_bfloat16* base = nullptr;      // device
  const int32_t* slot_idx = nullptr;  // device [n_seqs]
  int64_t slot_stride = 0;            // bf16 elements between consecutive slots (>= C * (W-1))
  // Decode only: when set, sequences s >= *live_tokens (device, read by the kernel: each graph replay sees its step's
  // count) are padding rows, as if their slot were < 0 (state untouched, zero output).
  const int32_t* live_tokens = nullptr;
};

// Decode: out[s] = short_conv of token x[s] continuing sequence s's state, which is then shifted by one token.
// Equivalent to short_conv_cuda with T = 1 on each sequence. x, out: [n_seqs, C] bf16; weight [C, W] fp32.
void short_conv_decode_cuda(const ShortConvDecodeParams& p, const __nv_bfloat16* x, const float* weight,
                            const ConvStateSlots& states, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace bg::ops

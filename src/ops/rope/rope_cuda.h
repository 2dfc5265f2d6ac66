// CUDA RoPE: rotates a slice of each bf16 head in place, with the same layout params and fp32 angle as the CPU
// reference (angle = float(position) * inv_freq[i], cos and sin scaled by attention_factor).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/rope/rope_params.h"

namespace bg::ops {

// x: bf16 at the strides of p (in elements); positions: [n_tokens] int64 (device); inv_freq: [rope_dim / 2] fp32
// (device, RopeTable::inv_freq uploaded once); attention_factor: RopeTable::attention_factor.
void apply_rope_cuda(const RopeParams& p, const int64_t* positions, const float* inv_freq, float attention_factor,
                     __nv_bfloat16* x, cudaStream_t stream);

}  // namespace bg::ops

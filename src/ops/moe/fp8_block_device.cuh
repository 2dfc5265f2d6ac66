// One warp's 128-input E4M3 block, shared by the FP8 paths that quantize activations (the FP8 prefill path's x and h,
// moe_fp8_cuda.cu; the ll exchange's FP8 dispatch payload, moe/cuda/ll_exchange.cu): lane l holds inputs 4 l .. 4 l + 3;
// scale = max |x| / 448 over the block (1 for an all-zero block), codes = e4m3(x / scale), round to nearest even,
// saturating. The host references (ops/moe/moe_fp8.h, ops::ll_fp8_roundtrip_cpu) do the same arithmetic.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace bg::ops {

// The block's scale, in every lane (a full-warp reduction: all 32 lanes must call it).
__device__ __forceinline__ float fp8_block_scale_warp(const float (&v)[4]) {
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  return amax > 0.0f ? amax / 448.0f : 1.0f;
}

// The lane's four codes, input 4 l + i in byte i.
__device__ __forceinline__ uint32_t fp8_codes4(const float (&v)[4], float scale) {
  uint32_t codes = 0;
  for (int i = 0; i < 4; ++i) {
    codes |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(v[i] / scale, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  }
  return codes;
}

}  // namespace bg::ops

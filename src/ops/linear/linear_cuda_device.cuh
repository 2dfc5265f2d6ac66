// Device-side pieces shared by the linear and MoE kernels: decoding eight stored weights (bf16 / FP8 E4M3 + block
// scale / MXFP4 E2M1 + E8M0 scale) into fp32 registers, and the skinny weight-streaming block that dots a group of
// weight rows with up to 16 tokens. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "ops/linear/linear_cuda.h"

namespace bg::ops::cudadev {

// Skinny kernel shape: 8 warps, 2 rows per warp (16 rows per block), 16 tokens per pass, 256 k per stage (8 per lane).
inline constexpr int kSkinnyWarps = 8;
inline constexpr int kSkinnyThreads = kSkinnyWarps * 32;
inline constexpr int kSkinnyRowsPerWarp = 2;
inline constexpr int kSkinnyRowsPerBlock = kSkinnyWarps * kSkinnyRowsPerWarp;
inline constexpr int kSkinnyTokens = 16;
inline constexpr int kSkinnyChunk = 256;

// E8M0 -> 2^(s-127); 0xff is NaN (poisons its whole group, as the format says). s = 0 is the fp32 subnormal 2^-127.
__device__ __forceinline__ float e8m0_to_float(uint32_t s) {
  if (s == 0xffu) return __uint_as_float(0x7fc00000u);
  return s == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);
}

// E2M1 magnitude codes 0..7 are {0, .5, 1, 1.5, 2, 3, 4, 6}: twice that, {0,1,2,3,4,6,8,12}, packed as nibbles of one
// constant, so decoding is a shift and a mask (no table in memory). The caller multiplies by 0.5 * scale.
__device__ __forceinline__ float e2m1_twice(uint32_t code) {
  const float mag = static_cast<float>((0xC8643210u >> ((code & 7u) * 4u)) & 0xfu);
  return (code & 8u) ? -mag : mag;
}

// Two E4M3 bytes (low byte = lower element) -> two floats, exactly (every E4M3 value is an fp16 value).
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t two) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(raw));
}

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t two) {
  return make_float2(__uint_as_float(two << 16), __uint_as_float(two & 0xffff0000u));
}

// Eight weights W[row, k0 .. k0+8) into v (fp32, before scaling) and the scale that multiplies all eight. k0 % 8 == 0,
// so the eight never straddle an MXFP4 group (32) or an FP8 block (128). Elements at k >= n_in read as 0. The vector
// path needs n_in % 8 == 0 (row starts aligned to the load width); other widths take the scalar path.
template <WeightFormat F>
__device__ __forceinline__ float load_weight8(const DeviceWeight& w, int64_t row, int64_t k0, float (&v)[8]) {
  const int64_t n_in = w.n_in;
  const bool full = (n_in % 8 == 0) && (k0 + 8 <= n_in);
  if constexpr (F == WeightFormat::kDense) {
    const auto* p = static_cast<const __nv_bfloat16*>(w.data) + row * n_in + k0;
    if (full) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = bf16x2_to_float2(words[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = k0 + i < n_in ? __bfloat162float(p[i]) : 0.0f;
    }
    return 1.0f;
  } else if constexpr (F == WeightFormat::kFp8Block) {
    const auto* p = static_cast<const uint8_t*>(w.data) + row * n_in + k0;
    if (full) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
      const uint32_t words[2] = {q.x, q.y};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 lo = fp8x2_to_float2(words[i]), hi = fp8x2_to_float2(words[i] >> 16);
        v[4 * i] = lo.x;
        v[4 * i + 1] = lo.y;
        v[4 * i + 2] = hi.x;
        v[4 * i + 3] = hi.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = k0 + i < n_in ? fp8x2_to_float2(p[i]).x : 0.0f;
    }
    const int64_t n_col_blocks = (n_in + 127) / 128;
    return __ldg(static_cast<const float*>(w.scale) + (row / 128) * n_col_blocks + k0 / 128);
  } else {
    // MXFP4: n_in % 32 == 0 is checked at the boundary, so eight elements are always whole (4 bytes, aligned).
    const auto* p = static_cast<const uint8_t*>(w.data) + row * (n_in / 2) + k0 / 2;
    const uint32_t q = __ldg(reinterpret_cast<const uint32_t*>(p));
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e2m1_twice(q >> (4 * i));
    const uint32_t s = __ldg(static_cast<const uint8_t*>(w.scale) + row * (n_in / 32) + k0 / 32);
    return 0.5f * e8m0_to_float(s);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// One block of the skinny kernel: rows [row0, row0 + 16) of each of kMats weights (same shape; kMats = 2 computes a
// gate and an up projection side by side) dotted with tokens [0, n_tok) of x (n_tok <= 16, row stride n_in). Each warp
// streams its rows once (8 consecutive weights per lane per stage) while the block stages x in shared memory as bf16;
// fp32 partial sums per lane, reduced across the warp at the end. Then, for each valid (row, token), the lane whose
// index is the token calls epi(row, token, vals) with vals[kMats] the finished dot products.
// Must be called by all kSkinnyThreads threads of the block (it synchronizes).
template <WeightFormat F, int kMats, typename Epilogue>
__device__ void skinny_block(const DeviceWeight (&w)[kMats], const __nv_bfloat16* x, int n_tok, int64_t row0,
                             Epilogue&& epi) {
  constexpr int R = kSkinnyRowsPerWarp;
  __shared__ __align__(16) __nv_bfloat16 xs[kSkinnyTokens][kSkinnyChunk];  // 8 KiB
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t n_in = w[0].n_in, n_out = w[0].n_out;
  const bool x_vec = n_in % 8 == 0;
  float acc[kMats][R][kSkinnyTokens] = {};

  for (int64_t kc = 0; kc < n_in; kc += kSkinnyChunk) {
    __syncthreads();  // the previous stage is consumed
    // Stage x[0:16, kc:kc+256] (zeros past n_tok / n_in): 16 tokens x 32 segments of 8 elements.
    for (int i = static_cast<int>(threadIdx.x); i < kSkinnyTokens * 32; i += kSkinnyThreads) {
      const int t = i / 32, seg = i % 32;
      const int64_t k = kc + seg * 8;
      uint4 q = make_uint4(0, 0, 0, 0);
      if (t < n_tok && k < n_in) {
        const __nv_bfloat16* src = x + t * n_in + k;
        if (x_vec) {
          q = __ldg(reinterpret_cast<const uint4*>(src));
        } else {
          __nv_bfloat16 tmp[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) tmp[j] = k + j < n_in ? src[j] : __float2bfloat16(0.0f);
          q = *reinterpret_cast<const uint4*>(tmp);
        }
      }
      *reinterpret_cast<uint4*>(&xs[t][seg * 8]) = q;
    }
    __syncthreads();

    const int64_t k0 = kc + lane * 8;
    if (k0 >= n_in) continue;  // this lane's eight are past the end (no sync until the next stage)
    float wv[kMats][R][8];
    float ws[kMats][R];
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = row0 + warp * R + r;
        if (row < n_out) {
          ws[m][r] = load_weight8<F>(w[m], row, k0, wv[m][r]);
        } else {
          ws[m][r] = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) wv[m][r][i] = 0.0f;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kSkinnyTokens; ++t) {
      if (t >= n_tok) break;
      const uint4 q = *reinterpret_cast<const uint4*>(&xs[t][lane * 8]);
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
      float xv[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = bf16x2_to_float2(words[i]);
        xv[2 * i] = f.x;
        xv[2 * i + 1] = f.y;
      }
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float d = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) d = fmaf(wv[m][r][i], xv[i], d);
          acc[m][r][t] = fmaf(ws[m][r], d, acc[m][r][t]);
        }
      }
    }
  }

  // Reduce across the warp; lane t writes token t.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = row0 + warp * R + r;
#pragma unroll
    for (int t = 0; t < kSkinnyTokens; ++t) {
      if (t >= n_tok) break;  // uniform across the warp
      float vals[kMats];
#pragma unroll
      for (int m = 0; m < kMats; ++m) vals[m] = warp_sum(acc[m][r][t]);
      if (lane == t && row < n_out) epi(row, t, vals);
    }
  }
}

}  // namespace bg::ops::cudadev

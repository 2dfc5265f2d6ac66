// The MLA prefill kernels' shared part (mla_prefill_cuda.cu, mla_prefill_mma_sync.cu, mla_prefill_wgmma.cu): the
// attention kernels' argument block, the head-dim constants, the PTX primitives, the per-row state / output helpers
// and the two attention launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/mla/mla_decode_mma.cuh"
#include "ops/mla/mla_prefill_cuda.h"

namespace bg::ops::mla_prefill {

using bf16 = __nv_bfloat16;

constexpr int kTileQ = static_cast<int>(kMlaPrefillTileQ);  // 128 query rows per CTA
constexpr int kQk = static_cast<int>(kMlaPrefillQk);        // 192
constexpr int kNope = static_cast<int>(kMlaPrefillNope);    // 128
constexpr int kRope = static_cast<int>(kMlaPrefillRope);    // 64
constexpr int kV = static_cast<int>(kMlaPrefillV);          // 128
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kNoPosition = 0x7fffffff;  // query rows past the tile: see every key

// One attention launch (one pass of the plan).
struct AttnArgs {
  const bf16* q;          // row t, head h at q + t * q_row + h * q_head; 192 values (nope 128 | rope 64)
  int64_t q_row, q_head;  // elements
  const bf16* k_nope;     // [rows, H, 128]
  const bf16* v;          // [rows, H, 128]
  const bf16* k_pe;       // [rows, 64]
  const int64_t* positions;
  const MlaPrefillItem* items;
  bf16* out;  // [n_tokens, H, v_head]
  float* state_o;
  float* state_ml;
  int n_heads, v_head;
  float scale_log2;
};

// The PTX primitives the decode kernel defines (cp.async, ldmatrix, the wgmma fences).
using mla_decode::cp_async16;
using mla_decode::cp_async_commit;
using mla_decode::fence_operands;
using mla_decode::fence_proxy_async;
using mla_decode::ldmatrix_x4;
using mla_decode::ldmatrix_x4_trans;
using mla_decode::smem_addr;
using mla_decode::wgmma_commit;
using mla_decode::wgmma_fence;
using mla_decode::wgmma_rs_n64;
__device__ __forceinline__ void cp_async_wait_all() { mla_decode::cp_async_wait<0>(); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One query row's softmax state and output, shared by both kernels. A thread holds, per row, two adjacent columns of
// each of the 16 n8 tiles of the 128 output columns: 8 c8 + 2 (lane % 4) + {0, 1}; `acc(c8)` is that float2.
// Continues a stored state (have) or starts empty: o, the running max and the quad's sum (kept in one lane).
template <typename Acc>
__device__ __forceinline__ void load_row_state(const AttnArgs& a, int64_t sr, bool have, int lane, float& m, float& l,
                                               Acc acc) {
  m = have ? a.state_ml[2 * sr] : -INFINITY;
  l = have && lane % 4 == 0 ? a.state_ml[2 * sr + 1] : 0.0f;
#pragma unroll
  for (int c8 = 0; c8 < kV / 8; ++c8) {
    const int col = 8 * c8 + 2 * (lane % 4);
    acc(c8) = have ? make_float2(a.state_o[sr * kV + col], a.state_o[sr * kV + col + 1]) : make_float2(0.0f, 0.0f);
  }
}
// The normalised output (final: the tile's last keys) or the unnormalised state for the next pass. `sum` is the
// row's whole sum (reduced over the quad).
template <typename Acc>
__device__ __forceinline__ void store_row(const AttnArgs& a, int64_t sr, bool final_pass, int lane, float m, float sum,
                                          Acc acc) {
  if (final_pass) {
    const float inv = 1.0f / sum;
    bf16* dst = a.out + sr * a.v_head;
#pragma unroll
    for (int c8 = 0; c8 < kV / 8; ++c8) {
      const int col = 8 * c8 + 2 * (lane % 4);
      const float2 v = acc(c8);
      if (col < a.v_head) dst[col] = __float2bfloat16(v.x * inv);
      if (col + 1 < a.v_head) dst[col + 1] = __float2bfloat16(v.y * inv);
    }
    return;
  }
  float* dst = a.state_o + sr * kV;
#pragma unroll
  for (int c8 = 0; c8 < kV / 8; ++c8) *reinterpret_cast<float2*>(dst + 8 * c8 + 2 * (lane % 4)) = acc(c8);
  if (lane % 4 == 0) {
    a.state_ml[2 * sr] = m;
    a.state_ml[2 * sr + 1] = sum;
  }
}
// A thread's view of two accumulator registers as the float2 of one (row, n8 tile).
struct AccPair {
  float& x;
  float& y;
  __device__ __forceinline__ AccPair& operator=(float2 v) {
    x = v.x;
    y = v.y;
    return *this;
  }
  __device__ __forceinline__ operator float2() const { return make_float2(x, y); }
};

// The attention kernel of one pass: grid (pass items, heads), its dynamic shared memory opted in first; and the
// kernel's attributes (registers, spills) and shared memory per CTA, for the benchmark.
void launch_attention_mma_sync(const AttnArgs& a, unsigned n_items, unsigned n_heads, cudaStream_t stream);
void launch_attention_wgmma(const AttnArgs& a, unsigned n_items, unsigned n_heads, cudaStream_t stream);
MlaPrefillKernelInfo attention_info_mma_sync();
MlaPrefillKernelInfo attention_info_wgmma();

}  // namespace bg::ops::mla_prefill

// Device helpers shared by the small CUDA ops: bf16 <-> fp32, deterministic warp / block reductions (fixed order, so
// the same input gives the same bits on every run), grid sizing, and a row-norm kernel (sum of squares per row in
// fp32, then a per-element epilogue) used by rmsnorm, kda_l2norm and gated_rmsnorm. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace bg::ops::cuda_util {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 to_bf16(float v) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ bf16 bf16_nan() { return __ushort_as_bfloat16(static_cast<unsigned short>(0x7fc0)); }

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};

// Butterfly reduction over the 32 lanes; every lane gets the result (same order on every lane and every run).
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduction over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// scratch: 32 entries of shared memory, reusable right after the call returns.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int n_warps = static_cast<int>(blockDim.x) >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // a previous call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : identity;
  return warp_reduce(v, op);
}

// The state slot of row s of a step, or -1 for a padding row (s >= *live_tokens, when live_tokens is set). Both loads
// are issued before either value is used (volatile asm stays in program order and is never sunk into the branch that
// uses it), so a slot read never waits for the live count: one memory latency at a thread's start, not two. (Not
// measured alone: the 37 % the KDA recurrent step lost at batch 64 in the same change was its register count.)
__device__ __forceinline__ int32_t live_slot(const int32_t* slot_idx, const int32_t* live_tokens, int64_t s) {
  int32_t slot = 0, live = INT32_MAX;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(slot) : "l"(slot_idx + s));
  if (live_tokens != nullptr) asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(live) : "l"(live_tokens));
  return s < live ? slot : -1;
}

// Blocks for a grid-stride elementwise loop over n items: enough to fill the GPU, never more than needed.
inline unsigned elementwise_blocks(int64_t n, int threads) {
  const int64_t needed = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(needed, 1, 132 * 16));
}

// One row per warp (8 rows per 256-thread block) when dim <= kWarpRowMaxDim, else one 256-thread block per row.
inline constexpr int64_t kWarpRowMaxDim = 1024;
inline constexpr int kRowThreads = 256;

// Row norm: for row r, ss = sum_d op.load(r, d)^2 in fp32 (d = lane, lane + step, ... in that order); then
// op.store(r, d, op.load(r, d), f, op.aux(r, d)) with f = op.factor(ss). Op::Aux is what the epilogue reads besides
// the value (a weight, a gate). With kPer > 0 each thread keeps its kPer values and auxiliaries in registers, all
// loaded before anything is stored, so a row costs one memory latency instead of one per element (stores and loads
// through unrelated pointers cannot be reordered by the compiler); kPer == 0 (dims past the register tiers) loads
// twice. Every element of a row is read before any is written, so op may write in place.
template <bool kWarpPerRow, int kPer, typename Op>
__global__ void __launch_bounds__(kRowThreads) row_norm_kernel(int64_t n_rows, int64_t dim, Op op) {
  __shared__ float scratch[32];
  const int64_t lane = kWarpPerRow ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t step = kWarpPerRow ? 32 : blockDim.x;
  const int64_t row = kWarpPerRow ? static_cast<int64_t>(blockIdx.x) * (kRowThreads / 32) + (threadIdx.x >> 5)
                                  : static_cast<int64_t>(blockIdx.x);
  if (kWarpPerRow && row >= n_rows) return;  // whole warps leave together: the shuffles below stay full
  float ss = 0.0f;
  constexpr int kN = kPer > 0 ? kPer : 1;
  float v[kN];
  typename Op::Aux a[kN];
  if constexpr (kPer > 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t d = lane + i * step;
      v[i] = d < dim ? op.load(row, d) : 0.0f;
      if (d < dim) a[i] = op.aux(row, d);
    }
#pragma unroll
    for (int i = 0; i < kPer; ++i) ss += v[i] * v[i];  // zeros past dim change nothing
  } else {
    for (int64_t d = lane; d < dim; d += step) {
      const float x = op.load(row, d);
      ss += x * x;
    }
  }
  if constexpr (kWarpPerRow) {
    ss = warp_reduce(ss, SumOp{});
  } else {
    ss = block_reduce(ss, SumOp{}, 0.0f, scratch);
  }
  const float f = op.factor(ss);
  if constexpr (kPer > 0) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t d = lane + i * step;
      if (d < dim) op.store(row, d, v[i], f, a[i]);
    }
  } else {
    for (int64_t d = lane; d < dim; d += step) op.store(row, d, op.load(row, d), f, op.aux(row, d));
  }
}

// Launches row_norm_kernel with the row mapping and register tier that suit dim. n_rows > 0.
template <typename Op>
void launch_row_norm(int64_t n_rows, int64_t dim, const Op& op, cudaStream_t stream) {
  if (dim <= kWarpRowMaxDim) {
    constexpr int64_t rows_per_block = kRowThreads / 32;
    const auto blocks = static_cast<unsigned>((n_rows + rows_per_block - 1) / rows_per_block);
    if (dim <= 4 * 32) {
      row_norm_kernel<true, 4><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    } else if (dim <= 8 * 32) {
      row_norm_kernel<true, 8><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    } else {
      row_norm_kernel<true, 32><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    }
  } else {
    const auto blocks = static_cast<unsigned>(n_rows);
    if (dim <= 8 * kRowThreads) {
      row_norm_kernel<false, 8><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    } else if (dim <= 16 * kRowThreads) {
      row_norm_kernel<false, 16><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    } else if (dim <= 32 * kRowThreads) {
      row_norm_kernel<false, 32><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    } else {
      row_norm_kernel<false, 0><<<blocks, kRowThreads, 0, stream>>>(n_rows, dim, op);
    }
  }
}

// Exclusive prefix sum of v over the block's kThreads threads in thread order (kThreads a multiple of 32, at most
// 1024); *total receives the block's sum. warp_sums: kThreads / 32 ints of shared memory. Every thread of the block
// calls it; it ends with a barrier, so warp_sums can be reused by the next call. Integer additions: exact.
template <int kThreads>
__device__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr int kWarps = kThreads / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int x = lane < kWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += n;
    }
    if (lane < kWarps) warp_sums[lane] = x;  // inclusive over warps
  }
  __syncthreads();
  const int before = warp > 0 ? warp_sums[warp - 1] : 0;
  *total = warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + incl - v;
}

}  // namespace bg::ops::cuda_util

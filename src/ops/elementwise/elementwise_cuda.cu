// CUDA residual add and sigmoid gate: grid-stride loops, one element per thread per step; the column split.
#include "ops/elementwise/elementwise_cuda.h"

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;
using cuda_util::to_bf16;
using cuda_util::to_f32;

constexpr int kThreads = 256;

__global__ void add_inplace_kernel(int64_t n, const bf16* x, bf16* y) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    y[i] = to_bf16(to_f32(y[i]) + to_f32(x[i]));
  }
}

// x packed [n / cols, cols]; gate's rows gate_ld elements apart (gate_ld == cols: packed, no index division).
__global__ void sigmoid_gate_kernel(int64_t n, int64_t cols, const bf16* gate, int64_t gate_ld, bf16* x) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool packed = gate_ld == cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t g = packed ? i : i / cols * gate_ld + i % cols;
    x[i] = to_bf16(to_f32(x[i]) * (1.0f / (1.0f + expf(-to_f32(gate[g])))));
  }
}

// The slices of one split, in copy units (one bf16, or 8 of them as a uint4).
template <typename U>
struct SplitArgs {
  const U* src;
  int64_t rows, src_cols;
  int n;
  int64_t col0[kMaxColumnSlices], cols[kMaxColumnSlices], start[kMaxColumnSlices + 1];  // start: prefix of cols
  U* dst[kMaxColumnSlices];
};

// grid (x: units of a row, y: rows, strided).
template <typename U>
__global__ void split_columns_kernel(const SplitArgs<U> a) {
  const int64_t width = a.start[a.n];
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < width;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      int i = 0;
      while (j >= a.start[i + 1]) ++i;
      const int64_t c = j - a.start[i];
      a.dst[i][r * a.cols[i] + c] = a.src[r * a.src_cols + a.col0[i] + c];
    }
  }
}

template <typename U>
void launch_split(int64_t rows, const void* src, int64_t src_cols, std::span<const ColumnSlice> slices, int64_t unit,
                  cudaStream_t stream) {
  SplitArgs<U> a{static_cast<const U*>(src), rows, src_cols / unit, static_cast<int>(slices.size()), {}, {}, {}, {}};
  for (size_t i = 0; i < slices.size(); ++i) {
    a.col0[i] = slices[i].col0 / unit;
    a.cols[i] = slices[i].cols / unit;
    a.start[i + 1] = a.start[i] + a.cols[i];
    a.dst[i] = static_cast<U*>(slices[i].dst);
  }
  const int64_t width = a.start[a.n];
  if (rows == 0 || width == 0) return;
  const auto x = static_cast<unsigned>(std::min<int64_t>((width + kThreads - 1) / kThreads, 64));
  const auto y = static_cast<unsigned>(std::min<int64_t>(rows, 65535));
  split_columns_kernel<U><<<dim3(x, y), kThreads, 0, stream>>>(a);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace

void split_columns_cuda(int64_t rows, const __nv_bfloat16* src, int64_t src_cols, std::span<const ColumnSlice> slices,
                        cudaStream_t stream) {
  check_column_slices(rows, src_cols, src, slices, "split_columns_cuda");
  bool vec = src_cols % 8 == 0 && cuda::aligned_to(src, 16);
  for (const ColumnSlice& s : slices) vec = vec && s.col0 % 8 == 0 && s.cols % 8 == 0 && cuda::aligned_to(s.dst, 16);
  if (vec) {
    launch_split<uint4>(rows, src, src_cols, slices, 8, stream);
  } else {
    launch_split<bf16>(rows, src, src_cols, slices, 1, stream);
  }
}

void add_inplace_cuda(int64_t n, const __nv_bfloat16* x, __nv_bfloat16* y, cudaStream_t stream) {
  BG_CHECK(n >= 0, "add_inplace_cuda: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(x && y, "add_inplace_cuda: null pointer with n {}", n);
  add_inplace_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(n, x, y);
  BG_CUDA_CHECK_LAUNCH();
}

void sigmoid_gate_cuda(int64_t n, const __nv_bfloat16* gate, __nv_bfloat16* x, cudaStream_t stream) {
  BG_CHECK(n >= 0, "sigmoid_gate_cuda: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(gate && x, "sigmoid_gate_cuda: null pointer with n {}", n);
  sigmoid_gate_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(n, n, gate, n, x);
  BG_CUDA_CHECK_LAUNCH();
}

void sigmoid_gate_cuda(int64_t rows, int64_t cols, const __nv_bfloat16* gate, int64_t gate_ld, __nv_bfloat16* x,
                       cudaStream_t stream) {
  BG_CHECK(rows >= 0 && cols > 0, "sigmoid_gate_cuda: bad shape [{}, {}]", rows, cols);
  if (gate_ld == 0) gate_ld = cols;
  BG_CHECK(gate_ld >= cols, "sigmoid_gate_cuda: gate rows {} elements apart for {} values", gate_ld, cols);
  const int64_t n = rows * cols;
  if (n == 0) return;
  BG_CHECK(gate && x, "sigmoid_gate_cuda: null pointer with [{}, {}]", rows, cols);
  sigmoid_gate_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(n, cols, gate, gate_ld,
                                                                                          x);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

// CUDA residual add and sigmoid gate: grid-stride loops, one element per thread per step.
#include "ops/elementwise/elementwise_cuda.h"

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

__global__ void sigmoid_gate_kernel(int64_t n, const bf16* gate, bf16* x) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    x[i] = to_bf16(to_f32(x[i]) * (1.0f / (1.0f + expf(-to_f32(gate[i])))));
  }
}

}  // namespace

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
  sigmoid_gate_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(n, gate, x);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

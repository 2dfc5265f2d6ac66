// CUDA SwiGLU: a grid-stride elementwise loop with the CPU reference's formula g / (1 + exp(-g)) * u.
#include "ops/swiglu/swiglu_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;

__global__ void swiglu_kernel(int64_t n, const bf16* gate, const bf16* up, bf16* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const float g = cuda_util::to_f32(gate[i]);
    // exp(-g) overflows to inf for g < -88: silu is then -0, as on the CPU.
    out[i] = cuda_util::to_bf16(g / (1.0f + expf(-g)) * cuda_util::to_f32(up[i]));
  }
}

}  // namespace

void swiglu_cuda(int64_t n, const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out,
                 cudaStream_t stream) {
  BG_CHECK(n >= 0, "swiglu_cuda: n {} is negative", n);
  if (n == 0) return;
  BG_CHECK(gate && up && out, "swiglu_cuda: null pointer with n {}", n);
  swiglu_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(n, gate, up, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

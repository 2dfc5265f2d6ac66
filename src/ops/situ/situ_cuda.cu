// CUDA SiTU: a grid-stride elementwise loop with the CPU reference's formula and order of operations.
#include "ops/situ/situ_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;

// Packed rows: gate_ld = up_ld = n_inter, the index is the element's.
__global__ void situ_kernel(int64_t n, SituParams p, float inv_beta, float inv_beta_lin, const bf16* gate,
                            int64_t gate_ld, const bf16* up, int64_t up_ld, bf16* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool packed = gate_ld == p.n_inter && up_ld == p.n_inter;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t t = packed ? 0 : i / p.n_inter, c = packed ? i : i % p.n_inter;
    const float g = cuda_util::to_f32(gate[t * gate_ld + c]);
    // sigmoid through 1 / (1 + exp(-g)): exactly 0 once exp overflows (g < -88).
    const float act = p.beta * tanhf(g * inv_beta) / (1.0f + expf(-g));
    const float lin = p.beta_lin * tanhf(cuda_util::to_f32(up[t * up_ld + c]) * inv_beta_lin);
    out[i] = cuda_util::to_bf16(act * lin);
  }
}

}  // namespace

void situ_cuda(const SituParams& p, const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out,
               cudaStream_t stream, int64_t gate_ld, int64_t up_ld) {
  BG_CHECK(p.n_tokens >= 0, "situ_cuda: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_inter > 0, "situ_cuda: n_inter {} must be positive", p.n_inter);
  BG_CHECK(p.beta > 0.0f && p.beta_lin > 0.0f, "situ_cuda: beta {} and beta_lin {} must be positive", p.beta,
           p.beta_lin);
  if (p.n_tokens == 0) return;
  BG_CHECK(gate && up && out, "situ_cuda: null pointer with n_tokens {}", p.n_tokens);
  if (gate_ld == 0) gate_ld = p.n_inter;
  if (up_ld == 0) up_ld = p.n_inter;
  BG_CHECK(gate_ld >= p.n_inter && up_ld >= p.n_inter, "situ_cuda: rows {} / {} elements apart for {} values",
           gate_ld, up_ld, p.n_inter);
  const int64_t n = p.n_tokens * p.n_inter;
  situ_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(
      n, p, 1.0f / p.beta, 1.0f / p.beta_lin, gate, gate_ld, up, up_ld, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

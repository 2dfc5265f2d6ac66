// CUDA SiTU: eight values per thread through 16-byte loads and stores when rows allow it (a 2-D grid: columns in x,
// rows in y, no index division per value), else a grid-stride loop over single values; both compute each value with
// the same instructions (situ_value), so they give the same bits, which are those of the one-value kernel before.
#include "ops/situ/situ_cuda.h"

#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 values per 16-byte access
constexpr unsigned kMaxRowBlocks = 65535;  // grid y limit; more rows are strided over
constexpr int64_t kVecMinRows = 64;

// The CPU reference's formula and order of operations (IEEE quotients). sigmoid through 1 / (1 + exp(-g)): exactly 0
// once exp overflows (g < -88). (__expf / __fdividef, as in the W4A16 kernels' GLU, change the bits; with them the
// offload-identity GPU test, which compares runs batched differently, failed on the H100: docs/PERF.md.)
__device__ __forceinline__ float situ_value(float g, float u, float inv_beta, float inv_beta_lin, float beta,
                                            float beta_lin) {
  const float act = beta * tanhf(g * inv_beta) / (1.0f + expf(-g));
  return act * (beta_lin * tanhf(u * inv_beta_lin));
}

// Any layout: one value per iteration; strided rows find its row and column by division, packed ones need not.
__global__ void situ_scalar_kernel(int64_t n, SituParams p, float inv_beta, float inv_beta_lin, const bf16* gate,
                                   int64_t gate_ld, const bf16* up, int64_t up_ld, bf16* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool packed = gate_ld == p.n_inter && up_ld == p.n_inter;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t t = packed ? 0 : i / p.n_inter, c = packed ? i : i % p.n_inter;
    out[i] = cuda_util::to_bf16(situ_value(cuda_util::to_f32(gate[t * gate_ld + c]),
                                           cuda_util::to_f32(up[t * up_ld + c]), inv_beta, inv_beta_lin, p.beta,
                                           p.beta_lin));
  }
}

// n_inter, gate_ld, up_ld multiples of 8 and every pointer 16-byte aligned: thread x of row y handles columns
// 8x .. 8x + 7. Both loads are issued before any math, and each thread writes only the values it read, so out may
// alias packed gate or up.
__global__ void situ_vec8_kernel(SituParams p, float inv_beta, float inv_beta_lin, const bf16* gate, int64_t gate_ld,
                                 const bf16* up, int64_t up_ld, bf16* out) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (c >= p.n_inter) return;
  for (int64_t t = blockIdx.y; t < p.n_tokens; t += gridDim.y) {
    const uint4 g = *reinterpret_cast<const uint4*>(gate + t * gate_ld + c);
    const uint4 u = *reinterpret_cast<const uint4*>(up + t * up_ld + c);
    const auto* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
    const auto* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
    uint4 r;
    auto* r2 = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      const float2 gf = __bfloat1622float2(g2[k]), uf = __bfloat1622float2(u2[k]);
      r2[k] = __halves2bfloat162(
          cuda_util::to_bf16(situ_value(gf.x, uf.x, inv_beta, inv_beta_lin, p.beta, p.beta_lin)),
          cuda_util::to_bf16(situ_value(gf.y, uf.y, inv_beta, inv_beta_lin, p.beta, p.beta_lin)));
    }
    *reinterpret_cast<uint4*>(out + t * p.n_inter + c) = r;
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

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
  const float inv_beta = 1.0f / p.beta, inv_beta_lin = 1.0f / p.beta_lin;
  // Eight values per thread from kVecMinRows rows: below, the grid-stride kernel's one value per thread spreads the
  // rows over more SMs (H100, K3's widths, `bench kernels` case situ: 3.3 against 3.9 us at 64 rows, but 2.4 against
  // 2.2 at 16 and, with the first version's approximate quotients, 1.7 against 1.3 at one).
  const bool vec8 = p.n_tokens >= kVecMinRows && p.n_inter % kVec == 0 && gate_ld % kVec == 0 &&
                    up_ld % kVec == 0 && aligned16(gate) && aligned16(up) && aligned16(out);
  if (vec8) {
    const int64_t threads_per_row = p.n_inter / kVec;
    const int threads = static_cast<int>(std::min<int64_t>(kThreads, (threads_per_row + 31) / 32 * 32));
    const dim3 grid(static_cast<unsigned>((threads_per_row + threads - 1) / threads),
                    static_cast<unsigned>(std::min<int64_t>(p.n_tokens, kMaxRowBlocks)));
    situ_vec8_kernel<<<grid, threads, 0, stream>>>(p, inv_beta, inv_beta_lin, gate, gate_ld, up, up_ld, out);
  } else {
    const int64_t n = p.n_tokens * p.n_inter;
    situ_scalar_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(
        n, p, inv_beta, inv_beta_lin, gate, gate_ld, up, up_ld, out);
  }
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

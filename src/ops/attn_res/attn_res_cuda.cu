// CUDA Attention-Residual mix: one block per token. Pass 1 accumulates, for every candidate at once, the sum of squares
// and the dot product with norm * proj; pass 2 writes the softmax-weighted sum of the raw candidates.
#include "ops/attn_res/attn_res_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMax = static_cast<int>(kAttnResMaxCandidates);

// grid (n_tokens), block 256. Per-thread partials live in registers (the candidate loops are unrolled to kMax with a
// bound check, so no local-memory arrays).
__global__ void __launch_bounds__(kThreads) attn_res_kernel(AttnResParams p, const bf16* candidates,
                                                            const float* norm, const float* proj, bf16* out) {
  __shared__ float partial[kWarps][2 * kMax];  // per warp: sum of squares, then dot, of each candidate
  __shared__ float alpha[kMax];
  const int n = static_cast<int>(p.n_candidates);
  const int64_t t = blockIdx.x, dim = p.dim;
  const int64_t cand_stride = p.n_tokens * dim;
  const bf16* base = candidates + t * dim;  // candidate i of this token: base + i * cand_stride

  float ss[kMax], dot[kMax];
#pragma unroll
  for (int i = 0; i < kMax; ++i) ss[i] = dot[i] = 0.0f;
  for (int64_t d = threadIdx.x; d < dim; d += kThreads) {
    const float np = norm[d] * proj[d];  // fp32 product, as the CPU reference precomputes it
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) {
        const float v = cuda_util::to_f32(base[i * cand_stride + d]);
        ss[i] += v * v;
        dot[i] += v * np;
      }
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < kMax; ++i) {
    if (i < n) {
      const float s = cuda_util::warp_reduce(ss[i], cuda_util::SumOp{});
      const float q = cuda_util::warp_reduce(dot[i], cuda_util::SumOp{});
      if (lane == 0) {
        partial[warp][i] = s;
        partial[warp][kMax + i] = q;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Scores and softmax on one thread: n <= 16 values, in the CPU reference's order.
    const float inv_dim = 1.0f / static_cast<float>(dim);
    float score[kMax];
    float max_score = -INFINITY;
    for (int i = 0; i < n; ++i) {
      float s = 0.0f, q = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        s += partial[w][i];
        q += partial[w][kMax + i];
      }
      score[i] = q / sqrtf(s * inv_dim + p.eps);  // the rms factor scales the dot product once
      max_score = fmaxf(max_score, score[i]);
    }
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += (score[i] = expf(score[i] - max_score));
    for (int i = 0; i < n; ++i) alpha[i] = score[i] / sum;
  }
  __syncthreads();
  bf16* ot = out + t * dim;
  for (int64_t d = threadIdx.x; d < dim; d += kThreads) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) acc += alpha[i] * cuda_util::to_f32(base[i * cand_stride + d]);
    }
    ot[d] = cuda_util::to_bf16(acc);
  }
}

}  // namespace

void attn_res_mix_cuda(const AttnResParams& p, const __nv_bfloat16* candidates, const float* norm, const float* proj,
                       __nv_bfloat16* out, cudaStream_t stream) {
  BG_CHECK(p.n_candidates > 0 && p.n_candidates <= kAttnResMaxCandidates,
           "attn_res_mix_cuda: n_candidates {} outside [1, {}]", p.n_candidates, kAttnResMaxCandidates);
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens < (int64_t{1} << 31), "attn_res_mix_cuda: bad n_tokens {}", p.n_tokens);
  BG_CHECK(p.dim > 0, "attn_res_mix_cuda: dim {} must be positive", p.dim);
  BG_CHECK(p.eps > 0.0f, "attn_res_mix_cuda: eps {} must be positive", p.eps);
  if (p.n_tokens == 0) return;
  BG_CHECK(candidates && norm && proj && out, "attn_res_mix_cuda: null pointer with n_tokens {}", p.n_tokens);
  attn_res_kernel<<<static_cast<unsigned>(p.n_tokens), kThreads, 0, stream>>>(p, candidates, norm, proj, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

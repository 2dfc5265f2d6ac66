// CUDA Attention-Residual mix: per-token softmax-weighted sum of bf16 candidates (fp32 math), same params as the CPU
// reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/attn_res/attn_res.h"

namespace bg::ops {

inline constexpr int64_t kAttnResMaxCandidates = 16;

// Which kernel runs a mix. kCluster: a cluster of up to 8 CTAs per token, each one slice of the row (rows of a
// multiple of 8 values up to 16384 with 16-byte aligned pointers; the block kernel for other rows). kBlock: one block
// of 512 threads per token (16-byte loads where the row allows). kScalar: the block kernel one value at a time
// (another summation order; for tests that ask whether a result rests on particular bits). kAuto: kCluster from
// kAttnResClusterMinCandidates candidates, kBlock below (measured on the H100: 8.2 / 9.3 / 11.8 against 11.1 / 16.8 /
// 18.3 us at 1 / 16 / 64 tokens with 9 candidates, 7.6 / 8.2 / 9.1 against 6.9 / 8.6 / 9.2 with 3; bench/RESULTS.md);
// BG_ATTN_RES=cluster|block|scalar (read once) makes kAuto that kernel everywhere. The kernels add in different
// orders, so their bits may differ; each is the same on every run and for a token whatever else is in the batch,
// and the choice depends on the layer (its candidates), never on the batch.
enum class AttnResKernel : uint8_t { kAuto, kCluster, kBlock, kScalar };
inline constexpr int64_t kAttnResClusterMinCandidates = 5;

// candidates: one device buffer, packed [n_candidates, n_tokens, dim] bf16 (candidate i at i * n_tokens * dim).
// norm, proj: [dim] fp32. out: [n_tokens, dim] bf16; may be one of the candidates (every element is written after the
// token's scores are complete, by the thread that read it). n_candidates <= kAttnResMaxCandidates.
void attn_res_mix_cuda(const AttnResParams& p, const __nv_bfloat16* candidates, const float* norm, const float* proj,
                       __nv_bfloat16* out, cudaStream_t stream, AttnResKernel kernel = AttnResKernel::kAuto);

// The mix followed by the RMSNorm the model applies to it, in one kernel: h = the mix (as attn_res_mix_cuda, h may be
// one of the candidates), then x = rmsnorm_cuda(h, rms_weight, rms_eps) over the bf16 values of h. rms_weight [dim]
// fp32; x [n_tokens, dim] bf16, distinct from h.
void attn_res_mix_rmsnorm_cuda(const AttnResParams& p, const __nv_bfloat16* candidates, const float* norm,
                               const float* proj, const float* rms_weight, float rms_eps, __nv_bfloat16* h,
                               __nv_bfloat16* x, cudaStream_t stream,
                               AttnResKernel kernel = AttnResKernel::kAuto);

// attn_res_mix_rmsnorm_cuda after the residual update it follows, in the same kernel: the last candidate (the partial
// sum, candidate n_candidates - 1 of the packed buffer) first becomes addend (replace) or bf16(partial + addend)
// (add_inplace_cuda's arithmetic), written back; then the mix and the norm as above, bit for bit the separate add /
// copy and attn_res_mix_rmsnorm_cuda. addend [n_tokens, dim] bf16; it, the partial sum, h and x do not overlap.
void attn_res_add_mix_rmsnorm_cuda(const AttnResParams& p, const __nv_bfloat16* addend, bool replace,
                                   __nv_bfloat16* candidates, const float* norm, const float* proj,
                                   const float* rms_weight, float rms_eps, __nv_bfloat16* h, __nv_bfloat16* x,
                                   cudaStream_t stream, AttnResKernel kernel = AttnResKernel::kAuto);

}  // namespace bg::ops

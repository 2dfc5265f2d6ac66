// CUDA Attention-Residual mix: one 512-thread block per token, 16-byte loads. Pass 1 accumulates, for every candidate
// at once, the sum of squares and the dot product with norm * proj; pass 2 writes the softmax-weighted sum of the raw
// candidates; the fused variant then RMS-normalises it (the next sublayer's input norm) in the same block.
#include "ops/attn_res/attn_res_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMax = static_cast<int>(kAttnResMaxCandidates);

struct FMax {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// kVec consecutive values from p: one 16-byte load of 8 bf16 (or two of 4 fp32), else one scalar.
template <int kVec>
__device__ __forceinline__ void load_vec(const bf16* p, float (&v)[kVec]) {
  if constexpr (kVec == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const bf16* b = reinterpret_cast<const bf16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = cuda_util::to_f32(b[k]);
  } else {
    v[0] = cuda_util::to_f32(*p);
  }
}
template <int kVec>
__device__ __forceinline__ void load_vec(const float* p, float (&v)[kVec]) {
  if constexpr (kVec == 8) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    v[0] = *p;
  }
}
template <int kVec>
__device__ __forceinline__ void store_vec(bf16* p, const float (&v)[kVec]) {
  if constexpr (kVec == 8) {
    uint4 u;
    bf16* b = reinterpret_cast<bf16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) b[k] = cuda_util::to_bf16(v[k]);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    *p = cuda_util::to_bf16(v[0]);
  }
}

// grid (n_tokens), block kThreads; each thread takes kVec consecutive elements at a time (16-byte loads when kVec is
// 8). Pass 1 accumulates, for every candidate at once, the sum of squares and the dot product with norm * proj (the
// per-thread partials live in registers: the candidate loops are unrolled to kMax with a bound check); one thread
// turns them into the softmax weights; pass 2 writes the weighted sum of the raw candidates to h. kNorm: then
// x = rms_weight * (h * inv), inv = 1 / sqrt(mean(h^2) + rms_eps) over the bf16 values of h just written (rmsnorm_cuda's
// formula), each thread reading back only what it wrote.
// kAdd: the last candidate (the partial sum) is first updated in pass 1, each element by the thread that reads it:
// partial = replace ? addend : bf16(partial + addend) (add_inplace_cuda's arithmetic), stored back; pass 2 reads it
// back (the same thread's own stores).
template <int kVec, bool kNorm, bool kAdd>
__global__ void __launch_bounds__(kThreads) attn_res_kernel(AttnResParams p, const bf16* candidates,
                                                            const float* norm, const float* proj,
                                                            const float* rms_weight, float rms_eps, bf16* h,
                                                            bf16* x, const bf16* addend, bool replace) {
  __shared__ float partial[kWarps][2 * kMax];  // per warp: sum of squares, then dot, of each candidate
  __shared__ float alpha[kMax];
  __shared__ float scratch[32];
  const int n = static_cast<int>(p.n_candidates);
  const int64_t t = blockIdx.x, dim = p.dim;
  const int64_t cand_stride = p.n_tokens * dim;
  const bf16* base = candidates + t * dim;  // candidate i of this token: base + i * cand_stride
  const int64_t first = static_cast<int64_t>(threadIdx.x) * kVec, step = int64_t{kThreads} * kVec;

  float ss[kMax], dot[kMax];
#pragma unroll
  for (int i = 0; i < kMax; ++i) ss[i] = dot[i] = 0.0f;
  for (int64_t d = first; d < dim; d += step) {
    float nw[kVec], pw[kVec];
    load_vec<kVec>(norm + d, nw);
    load_vec<kVec>(proj + d, pw);
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) {
        float v[kVec];
        if (kAdd && i == n - 1) {
          bf16* partial = const_cast<bf16*>(base + i * cand_stride + d);
          float a[kVec];
          load_vec<kVec>(addend + t * dim + d, a);
          if (replace) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) v[k] = a[k];
          } else {
            load_vec<kVec>(partial, v);
#pragma unroll
            for (int k = 0; k < kVec; ++k) v[k] = cuda_util::to_f32(cuda_util::to_bf16(v[k] + a[k]));
          }
          store_vec<kVec>(partial, v);
        } else {
          load_vec<kVec>(base + i * cand_stride + d, v);
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          ss[i] += v[k] * v[k];
          dot[i] += v[k] * (nw[k] * pw[k]);  // fp32 product, as the CPU reference precomputes it
        }
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
  if (warp == 0) {
    // Scores and softmax in warp 0, lane i for candidate i (n <= 32): each lane sums its candidate's per-warp partials
    // in warp order, the max is order-free, and every lane adds the exponentials in candidate order (the CPU
    // reference's order), so the weights are bit for bit those of a single thread doing it all -- which was a chain of
    // 2 * 16 * n dependent shared loads (1.4 us of this kernel's 12.6 at one token on the H200).
    static_assert(kMax <= 32);
    const float inv_dim = 1.0f / static_cast<float>(dim);
    float score = -INFINITY;
    if (lane < n) {
      float s = 0.0f, q = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        s += partial[w][lane];
        q += partial[w][kMax + lane];
      }
      score = q / sqrtf(s * inv_dim + p.eps);  // the rms factor scales the dot product once
    }
    const float max_score = cuda_util::warp_reduce(score, FMax{});  // fmaxf, as the single thread had
    const float e = lane < n ? expf(score - max_score) : 0.0f;
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += __shfl_sync(0xffffffffu, e, i);
    if (lane < n) alpha[lane] = e / sum;
  }
  __syncthreads();
  bf16* ht = h + t * dim;
  float hss = 0.0f;
  for (int64_t d = first; d < dim; d += step) {
    float acc[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) {
        float v[kVec];
        load_vec<kVec>(base + i * cand_stride + d, v);
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[k] += alpha[i] * v[k];
      }
    }
    store_vec<kVec>(ht + d, acc);
    if constexpr (kNorm) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float hb = cuda_util::to_f32(cuda_util::to_bf16(acc[k]));
        hss += hb * hb;
      }
    }
  }
  if constexpr (kNorm) {
    hss = cuda_util::block_reduce(hss, cuda_util::SumOp{}, 0.0f, scratch);
    const float inv = 1.0f / sqrtf(hss * (1.0f / static_cast<float>(dim)) + rms_eps);
    bf16* xt = x + t * dim;
    for (int64_t d = first; d < dim; d += step) {
      float v[kVec], w[kVec];
      load_vec<kVec>(ht + d, v);  // this thread's own stores
      load_vec<kVec>(rms_weight + d, w);
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[k] = w[k] * (v[k] * inv);
      store_vec<kVec>(xt + d, v);
    }
  }
}

void check_mix(const AttnResParams& p, const char* who) {
  BG_CHECK(p.n_candidates > 0 && p.n_candidates <= kAttnResMaxCandidates, "{}: n_candidates {} outside [1, {}]", who,
           p.n_candidates, kAttnResMaxCandidates);
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens < (int64_t{1} << 31), "{}: bad n_tokens {}", who, p.n_tokens);
  BG_CHECK(p.dim > 0, "{}: dim {} must be positive", who, p.dim);
  BG_CHECK(p.eps > 0.0f, "{}: eps {} must be positive", who, p.eps);
}

template <bool kNorm, bool kAdd = false>
void launch(const AttnResParams& p, const bf16* candidates, const float* norm, const float* proj,
            const float* rms_weight, float rms_eps, bf16* h, bf16* x, cudaStream_t stream,
            const bf16* addend = nullptr, bool replace = false) {
  auto a16 = [](const void* ptr) { return cuda::aligned_to(ptr, 16); };
  const bool vec = p.dim % 8 == 0 && a16(candidates) && a16(norm) && a16(proj) && a16(h) &&
                   (!kNorm || (a16(rms_weight) && a16(x))) && (!kAdd || a16(addend));
  const auto grid = static_cast<unsigned>(p.n_tokens);
  if (vec) {
    attn_res_kernel<8, kNorm, kAdd><<<grid, kThreads, 0, stream>>>(p, candidates, norm, proj, rms_weight, rms_eps, h,
                                                                   x, addend, replace);
  } else {
    attn_res_kernel<1, kNorm, kAdd><<<grid, kThreads, 0, stream>>>(p, candidates, norm, proj, rms_weight, rms_eps, h,
                                                                   x, addend, replace);
  }
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attn_res_mix_cuda(const AttnResParams& p, const __nv_bfloat16* candidates, const float* norm, const float* proj,
                       __nv_bfloat16* out, cudaStream_t stream) {
  check_mix(p, "attn_res_mix_cuda");
  if (p.n_tokens == 0) return;
  BG_CHECK(candidates && norm && proj && out, "attn_res_mix_cuda: null pointer with n_tokens {}", p.n_tokens);
  launch<false>(p, candidates, norm, proj, nullptr, 0.0f, out, nullptr, stream);
}

void attn_res_mix_rmsnorm_cuda(const AttnResParams& p, const __nv_bfloat16* candidates, const float* norm,
                               const float* proj, const float* rms_weight, float rms_eps, __nv_bfloat16* h,
                               __nv_bfloat16* x, cudaStream_t stream) {
  check_mix(p, "attn_res_mix_rmsnorm_cuda");
  BG_CHECK(rms_eps > 0.0f, "attn_res_mix_rmsnorm_cuda: rms eps {} must be positive", rms_eps);
  if (p.n_tokens == 0) return;
  BG_CHECK(candidates && norm && proj && rms_weight && h && x,
           "attn_res_mix_rmsnorm_cuda: null pointer with n_tokens {}", p.n_tokens);
  BG_CHECK(x != h, "attn_res_mix_rmsnorm_cuda: x must not be h");
  launch<true>(p, candidates, norm, proj, rms_weight, rms_eps, h, x, stream);
}

void attn_res_add_mix_rmsnorm_cuda(const AttnResParams& p, const __nv_bfloat16* addend, bool replace,
                                   __nv_bfloat16* candidates, const float* norm, const float* proj,
                                   const float* rms_weight, float rms_eps, __nv_bfloat16* h, __nv_bfloat16* x,
                                   cudaStream_t stream) {
  check_mix(p, "attn_res_add_mix_rmsnorm_cuda");
  BG_CHECK(rms_eps > 0.0f, "attn_res_add_mix_rmsnorm_cuda: rms eps {} must be positive", rms_eps);
  if (p.n_tokens == 0) return;
  BG_CHECK(addend && candidates && norm && proj && rms_weight && h && x,
           "attn_res_add_mix_rmsnorm_cuda: null pointer with n_tokens {}", p.n_tokens);
  BG_CHECK(x != h, "attn_res_add_mix_rmsnorm_cuda: x must not be h");
  const __nv_bfloat16* partial = candidates + (p.n_candidates - 1) * p.n_tokens * p.dim;
  const int64_t n_values = p.n_tokens * p.dim;
  auto overlaps = [&](const __nv_bfloat16* a, const __nv_bfloat16* b) { return a < b + n_values && b < a + n_values; };
  BG_CHECK(!overlaps(addend, partial) && !overlaps(h, partial) && !overlaps(x, partial) && !overlaps(addend, h),
           "attn_res_add_mix_rmsnorm_cuda: the addend, the partial sum, h and x must not overlap");
  launch<true, true>(p, candidates, norm, proj, rms_weight, rms_eps, h, x, stream, addend, replace);
}

}  // namespace bg::ops

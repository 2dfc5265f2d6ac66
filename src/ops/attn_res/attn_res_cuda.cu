// CUDA Attention-Residual mix, two kernels (AttnResKernel in the header says which runs). The cluster kernel, for rows
// of a multiple of 8 values (16-byte loads) up to 16384: a cluster of up to 8 CTAs per token, each CTA one slice of
// the row, one 16-byte vector of each candidate per thread held in registers from the load to the last use; the
// per-candidate sums of squares and dot products (then the mix's sum of squares, for the fused RMSNorm) are added over
// the cluster through distributed shared memory. The block kernel: one 512-thread block per token, two passes over
// the candidates. Both: pass 1 accumulates, for every candidate at once, the sum of squares and the dot product with
// norm * proj; pass 2 writes the softmax-weighted sum of the raw candidates; the fused variant then RMS-normalises it
// (the next sublayer's input norm).
#include "ops/attn_res/attn_res_cuda.h"

#include <cooperative_groups.h>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
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

// Lane 0 of each warp stores the warp's sums of squares and dots of the n candidates (butterfly over the lanes) at
// part[warp][i] and part[warp][kMax + i].
__device__ __forceinline__ void store_warp_sums(const float (&ss)[kMax], const float (&dot)[kMax], int n, int lane,
                                                float* part_of_warp) {
#pragma unroll
  for (int i = 0; i < kMax; ++i) {
    if (i < n) {
      const float s = cuda_util::warp_reduce(ss[i], cuda_util::SumOp{});
      const float q = cuda_util::warp_reduce(dot[i], cuda_util::SumOp{});
      if (lane == 0) {
        part_of_warp[i] = s;
        part_of_warp[kMax + i] = q;
      }
    }
  }
}

// Warp 0, lane i < n with candidate i's total sum of squares s and dot q: alpha[i] = the softmax of the scores
// q / sqrt(s / dim + eps) (the rms factor scales the dot product once). The max is order-free (fmaxf) and every lane
// adds the exponentials in candidate order (the CPU reference's order), so the weights are bit for bit those of one
// thread doing it all.
__device__ __forceinline__ void write_softmax(float s, float q, int lane, int n, int64_t dim, float eps,
                                              float* alpha) {
  static_assert(kMax <= 32);
  const float inv_dim = 1.0f / static_cast<float>(dim);
  const float score = lane < n ? q / sqrtf(s * inv_dim + eps) : -INFINITY;
  const float max_score = cuda_util::warp_reduce(score, FMax{});
  const float e = lane < n ? expf(score - max_score) : 0.0f;
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += __shfl_sync(0xffffffffu, e, i);
  if (lane < n) alpha[lane] = e / sum;
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
  store_warp_sums(ss, dot, n, lane, partial[warp]);
  __syncthreads();
  if (warp == 0) {
    // Scores and softmax in warp 0, lane i for candidate i (n <= 32): each lane sums its candidate's per-warp partials
    // in warp order, instead of thread 0 alone walking a chain of 2 * 16 * n dependent shared loads (1.4 us of this
    // kernel's 12.6 at one token on the H200).
    float s = 0.0f, q = 0.0f;
    if (lane < n) {
      for (int w = 0; w < kWarps; ++w) {
        s += partial[w][lane];
        q += partial[w][kMax + lane];
      }
    }
    write_softmax(s, q, lane, n, dim, p.eps, alpha);
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

// --- The cluster kernel -------------------------------------------------------------------------------------------
// A token's row is split over a cluster of `ctas` CTAs (attn_res_cluster_shape); CTA r of the cluster takes vectors
// [r * per_cta, (r + 1) * per_cta) of the row, one 8-value vector per thread. Every value a thread needs is loaded
// once, before any arithmetic (the candidates stay in registers as bf16 for pass 2), so a token costs one memory
// latency, not one per pass. Sums: each thread's 8 values in order, a butterfly over the warp, the warps in order,
// then the cluster's CTAs in rank order, read by every CTA from the others' shared memory; every CTA therefore
// computes the same softmax weights and RMS factor bit for bit, and none depends on the batch.
constexpr int kClusterMaxCtas = 8;
constexpr int kClusterMaxThreads = 256;
constexpr int kClusterMaxWarps = kClusterMaxThreads / 32;

__device__ __forceinline__ void unpack8(const uint4& u, float (&v)[8]) {
  const bf16* b = reinterpret_cast<const bf16*>(&u);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = cuda_util::to_f32(b[k]);
}
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  uint4 u;
  bf16* b = reinterpret_cast<bf16*>(&u);
#pragma unroll
  for (int k = 0; k < 8; ++k) b[k] = cuda_util::to_bf16(v[k]);
  return u;
}

template <bool kNorm, bool kAdd>
__global__ void __launch_bounds__(kClusterMaxThreads) attn_res_cluster_kernel(
    AttnResParams p, int per_cta, const bf16* candidates, const float* norm, const float* proj,
    const float* rms_weight, float rms_eps, bf16* h, bf16* x, const bf16* addend, bool replace) {
  namespace cg = cooperative_groups;
  __shared__ float warp_part[kClusterMaxWarps][2 * kMax];  // per warp: sums of squares, then dots
  __shared__ float cta_part[2 * kMax];                      // this CTA's, read by the whole cluster
  __shared__ float alpha[kMax];
  __shared__ float warp_hss[kClusterMaxWarps];
  __shared__ float cta_hss, inv_rms;
  const cg::cluster_group cluster = cg::this_cluster();
  const int ctas = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  const int n = static_cast<int>(p.n_candidates);
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int n_warps = static_cast<int>(blockDim.x) >> 5;
  const int64_t t = blockIdx.x / ctas, dim = p.dim, cand_stride = p.n_tokens * dim;
  const int64_t d = (static_cast<int64_t>(rank) * per_cta + threadIdx.x) * 8;
  const bool live = static_cast<int>(threadIdx.x) < per_cta && d < dim;
  const bf16* base = candidates + t * dim + d;  // candidate i: base + i * cand_stride

  uint4 raw[kMax];
  float ss[kMax], dot[kMax];
#pragma unroll
  for (int i = 0; i < kMax; ++i) ss[i] = dot[i] = 0.0f;
  if (live) {
    float nw[8], pw[8];
    load_vec<8>(norm + d, nw);
    load_vec<8>(proj + d, pw);
    uint4 add_raw{};
    if constexpr (kAdd) add_raw = *reinterpret_cast<const uint4*>(addend + t * dim + d);
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n && !(kAdd && replace && i == n - 1)) raw[i] = *reinterpret_cast<const uint4*>(base + i * cand_stride);
    }
    if constexpr (kAdd) {
      // The partial sum (the last candidate) becomes the addend or bf16(partial + addend), add_inplace_cuda's
      // arithmetic, stored back by the thread that read it.
#pragma unroll
      for (int i = 0; i < kMax; ++i) {
        if (i == n - 1) {
          if (replace) {
            raw[i] = add_raw;
          } else {
            float v[8], a[8];
            unpack8(raw[i], v);
            unpack8(add_raw, a);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] += a[k];
            raw[i] = pack8(v);
          }
          *reinterpret_cast<uint4*>(const_cast<bf16*>(base + i * cand_stride)) = raw[i];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) {
        float v[8];
        unpack8(raw[i], v);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          ss[i] += v[k] * v[k];
          dot[i] += v[k] * (nw[k] * pw[k]);  // fp32 product, as the CPU reference precomputes it
        }
      }
    }
  }
  store_warp_sums(ss, dot, n, lane, warp_part[warp]);
  __syncthreads();
  if (threadIdx.x < 2 * kMax && static_cast<int>(threadIdx.x) % kMax < n) {
    float sum = 0.0f;
    for (int w = 0; w < n_warps; ++w) sum += warp_part[w][threadIdx.x];
    cta_part[threadIdx.x] = sum;
  }
  cluster.sync();  // every CTA's partial sums are in its shared memory
  if (warp == 0) {
    float s = 0.0f, q = 0.0f;
    if (lane < n) {
      for (int r = 0; r < ctas; ++r) {
        const float* remote = cluster.map_shared_rank(cta_part, r);
        s += remote[lane];
        q += remote[kMax + lane];
      }
    }
    write_softmax(s, q, lane, n, dim, p.eps, alpha);
  }
  if constexpr (!kNorm) cluster.barrier_arrive();  // done reading the others' partial sums
  __syncthreads();
  float acc[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
  float hss = 0.0f;
  if (live) {
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) {
        float v[8];
        unpack8(raw[i], v);
        const float a = alpha[i];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += a * v[k];
      }
    }
    const uint4 hb = pack8(acc);
    *reinterpret_cast<uint4*>(h + t * dim + d) = hb;
    if constexpr (kNorm) {
      unpack8(hb, acc);  // the bf16 values of h, as rmsnorm_cuda reads them
#pragma unroll
      for (int k = 0; k < 8; ++k) hss += acc[k] * acc[k];
    }
  }
  if constexpr (kNorm) {
    hss = cuda_util::warp_reduce(hss, cuda_util::SumOp{});
    if (lane == 0) warp_hss[warp] = hss;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int w = 0; w < n_warps; ++w) sum += warp_hss[w];
      cta_hss = sum;
    }
    cluster.sync();  // every CTA's sum of squares is in place, and no CTA still reads cta_part
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int r = 0; r < ctas; ++r) sum += *cluster.map_shared_rank(&cta_hss, r);
      inv_rms = 1.0f / sqrtf(sum * (1.0f / static_cast<float>(dim)) + rms_eps);
    }
    cluster.barrier_arrive();  // done reading the others' shared memory
    __syncthreads();
    if (live) {
      const float inv = inv_rms;
      float w[8];
      load_vec<8>(rms_weight + d, w);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = w[k] * (acc[k] * inv);
      *reinterpret_cast<uint4*>(x + t * dim + d) = pack8(acc);
    }
  }
  cluster.barrier_wait();  // a CTA's shared memory must outlive the cluster's reads of it
}

// The cluster launch for a row of dim values: CTAs per token and vectors per CTA; {0, 0} where the cluster kernel
// does not apply (rows past kClusterMaxCtas * kClusterMaxThreads vectors).
struct ClusterShape {
  int ctas = 0, per_cta = 0;
};
ClusterShape cluster_shape(int64_t dim) {
  const int64_t vecs = dim / 8;
  if (vecs > int64_t{kClusterMaxCtas} * kClusterMaxThreads) return {};
  // About 128 vectors (one warp group of 16-byte loads per candidate) per CTA, at most kClusterMaxCtas CTAs.
  const int64_t ctas = std::max<int64_t>(1, std::min<int64_t>(kClusterMaxCtas, (vecs + 127) / 128));
  return {static_cast<int>(ctas), static_cast<int>((vecs + ctas - 1) / ctas)};
}

void check_mix(const AttnResParams& p, const char* who) {
  BG_CHECK(p.n_candidates > 0 && p.n_candidates <= kAttnResMaxCandidates, "{}: n_candidates {} outside [1, {}]", who,
           p.n_candidates, kAttnResMaxCandidates);
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens < (int64_t{1} << 31), "{}: bad n_tokens {}", who, p.n_tokens);
  BG_CHECK(p.dim > 0, "{}: dim {} must be positive", who, p.dim);
  BG_CHECK(p.eps > 0.0f, "{}: eps {} must be positive", who, p.eps);
}

AttnResKernel kernel_from_env() {
  static const int choice = env_choice("BG_ATTN_RES", {"cluster", "block", "scalar"});  // -1: unset
  constexpr AttnResKernel kChoices[] = {AttnResKernel::kCluster, AttnResKernel::kBlock, AttnResKernel::kScalar};
  return choice < 0 ? AttnResKernel::kAuto : kChoices[choice];
}

template <bool kNorm, bool kAdd = false>
void launch(AttnResKernel kernel, const AttnResParams& p, const bf16* candidates, const float* norm,
            const float* proj, const float* rms_weight, float rms_eps, bf16* h, bf16* x, cudaStream_t stream,
            const bf16* addend = nullptr, bool replace = false) {
  auto a16 = [](const void* ptr) { return cuda::aligned_to(ptr, 16); };
  bool vec = p.dim % 8 == 0 && a16(candidates) && a16(norm) && a16(proj) && a16(h) &&
                   (!kNorm || (a16(rms_weight) && a16(x))) && (!kAdd || a16(addend));
  if (kernel == AttnResKernel::kAuto) kernel = kernel_from_env();
  if (kernel == AttnResKernel::kAuto) {
    kernel = p.n_candidates >= kAttnResClusterMinCandidates ? AttnResKernel::kCluster : AttnResKernel::kBlock;
  }
  const ClusterShape shape = cluster_shape(p.dim);
  vec = vec && kernel != AttnResKernel::kScalar;
  if (vec && kernel == AttnResKernel::kCluster && shape.ctas > 0 && p.n_tokens * shape.ctas < (int64_t{1} << 31)) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(p.n_tokens * shape.ctas));
    cfg.blockDim = dim3(static_cast<unsigned>((shape.per_cta + 31) / 32 * 32));
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(shape.ctas);
    attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    BG_CUDA_CHECK(cudaLaunchKernelEx(&cfg, attn_res_cluster_kernel<kNorm, kAdd>, p, shape.per_cta, candidates, norm,
                                     proj, rms_weight, rms_eps, h, x, addend, replace));
    return;
  }
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
                       __nv_bfloat16* out, cudaStream_t stream, AttnResKernel kernel) {
  check_mix(p, "attn_res_mix_cuda");
  if (p.n_tokens == 0) return;
  BG_CHECK(candidates && norm && proj && out, "attn_res_mix_cuda: null pointer with n_tokens {}", p.n_tokens);
  launch<false>(kernel, p, candidates, norm, proj, nullptr, 0.0f, out, nullptr, stream);
}

void attn_res_mix_rmsnorm_cuda(const AttnResParams& p, const __nv_bfloat16* candidates, const float* norm,
                               const float* proj, const float* rms_weight, float rms_eps, __nv_bfloat16* h,
                               __nv_bfloat16* x, cudaStream_t stream, AttnResKernel kernel) {
  check_mix(p, "attn_res_mix_rmsnorm_cuda");
  BG_CHECK(rms_eps > 0.0f, "attn_res_mix_rmsnorm_cuda: rms eps {} must be positive", rms_eps);
  if (p.n_tokens == 0) return;
  BG_CHECK(candidates && norm && proj && rms_weight && h && x,
           "attn_res_mix_rmsnorm_cuda: null pointer with n_tokens {}", p.n_tokens);
  BG_CHECK(x != h, "attn_res_mix_rmsnorm_cuda: x must not be h");
  launch<true>(kernel, p, candidates, norm, proj, rms_weight, rms_eps, h, x, stream);
}

void attn_res_add_mix_rmsnorm_cuda(const AttnResParams& p, const __nv_bfloat16* addend, bool replace,
                                   __nv_bfloat16* candidates, const float* norm, const float* proj,
                                   const float* rms_weight, float rms_eps, __nv_bfloat16* h, __nv_bfloat16* x,
                                   cudaStream_t stream, AttnResKernel kernel) {
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
  launch<true, true>(kernel, p, candidates, norm, proj, rms_weight, rms_eps, h, x, stream, addend, replace);
}

}  // namespace bg::ops

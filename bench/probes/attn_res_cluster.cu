// NOT BUILT: the second attempt (2026-12-04 16:40 UTC) at the Attention-Residual mix with a token spread over a
// cluster of 8 CTAs, kept for the next attempt at the question it left open: the kernel that was added to
// src/ops/attn_res/attn_res_cuda.cu of commit 175a513 (each CTA an eighth of the columns, partial sums through
// distributed shared memory, every CTA the same softmax, 64-80 registers). On the H200: attn_res_mix_rmsnorm
// 11.2 -> 9.1 us at B = 1, 16.6 -> 11.8 at 16, 17.8 -> 13.3 at 64; AttnResParity.*, Cases/GoldenGpu.*,
// Models/StepGpu.*, BackendDiff.*, Cases/StreamedExpertsGpu.*,
// Archs/EngineStateGpu.DeterministicPrefixCacheOnGivesTheSameTokens pass;
// Archs/EngineStateGpu.OffloadedAndRestoredSequencesEqualRoomyOnes/kimi_k3 fails (sequence t1.2 from token 15,
// logprobs off by ~0.05), as the first, independent cluster version did (bench/RESULTS.md, 2026-12-04 08:12). The
// same run under --deterministic passes. See bench/RESULTS.md, 2026-12-04 16:40, for the open question.

// The cluster form: a token's columns split over kCluster CTAs of kCThreads (Kimi-K3, dim 7168: 896 columns, 112
// 16-byte vectors per CTA), so a decode step's few tokens are read by 8 SMs each instead of one (the 512-thread
// block per token took 11-18 us at batch 1-64 on the H200, most of it memory latency on a single SM). Per token:
// pass 1 as attn_res_kernel over the CTA's vectors; each CTA sums its warps' partials in warp order, a cluster
// barrier, then every CTA's warp 0 sums the kCluster CTAs' partials in rank order (distributed shared memory) and
// computes the same softmax weights bit for bit; pass 2 over its vectors; with kNorm the sum of squares of h goes
// through the same exchange. The same arithmetic order whatever the batch (a token's result never depends on the
// others). Clusters loop over tokens past gridDim.y.
constexpr int kCluster = 8;
constexpr int kCThreads = 128;
constexpr int kCWarps = kCThreads / 32;

template <bool kNorm, bool kAdd>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kCThreads)
    attn_res_cluster_kernel(AttnResParams p, const bf16* candidates, const float* norm, const float* proj,
                            const float* rms_weight, float rms_eps, bf16* h, bf16* x, const bf16* addend,
                            bool replace) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ float wpart[kCWarps][2 * kMax];  // per warp: sum of squares, then dot, of each candidate
  __shared__ float part[2][2 * kMax];         // this CTA's sums, double-buffered by token parity
  __shared__ float alpha[kMax];
  __shared__ float whss[kCWarps];
  __shared__ float hpart[2];                  // this CTA's sum of squares of h, by token parity
  const int n = static_cast<int>(p.n_candidates);
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t dim = p.dim, n_vec = dim / 8;
  const int64_t v0 = n_vec * rank / kCluster, v1 = n_vec * (rank + 1) / kCluster;
  const int64_t cand_stride = p.n_tokens * dim;
  int parity = 0;
  for (int64_t t = blockIdx.y; t < p.n_tokens; t += gridDim.y, parity ^= 1) {
    const bf16* base = candidates + t * dim;
    float ss[kMax], dot[kMax];
#pragma unroll
    for (int i = 0; i < kMax; ++i) ss[i] = dot[i] = 0.0f;
    for (int64_t v = v0 + threadIdx.x; v < v1; v += kCThreads) {
      const int64_t d = v * 8;
      float nw[8], pw[8];
      load_vec<8>(norm + d, nw);
      load_vec<8>(proj + d, pw);
#pragma unroll
      for (int i = 0; i < kMax; ++i) {
        if (i < n) {
          float val[8];
          if (kAdd && i == n - 1) {
            bf16* psum = const_cast<bf16*>(base + i * cand_stride + d);
            float a[8];
            load_vec<8>(addend + t * dim + d, a);
            if (replace) {
#pragma unroll
              for (int k = 0; k < 8; ++k) val[k] = a[k];
            } else {
              load_vec<8>(psum, val);
#pragma unroll
              for (int k = 0; k < 8; ++k) val[k] = cuda_util::to_f32(cuda_util::to_bf16(val[k] + a[k]));
            }
            store_vec<8>(psum, val);
          } else {
            load_vec<8>(base + i * cand_stride + d, val);
          }
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            ss[i] += val[k] * val[k];
            dot[i] += val[k] * (nw[k] * pw[k]);  // fp32 product, as the CPU reference precomputes it
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (i < n) {
        const float s = cuda_util::warp_reduce(ss[i], cuda_util::SumOp{});
        const float q = cuda_util::warp_reduce(dot[i], cuda_util::SumOp{});
        if (lane == 0) {
          wpart[warp][i] = s;
          wpart[warp][kMax + i] = q;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < 2 * kMax) {
      float s = 0.0f;
      for (int w = 0; w < kCWarps; ++w) s += wpart[w][threadIdx.x];
      part[parity][threadIdx.x] = s;
    }
    cluster.sync();  // every CTA's part[parity] is complete (and, parity before, read by everyone)
    if (warp == 0) {
      static_assert(kMax <= 32);
      const float inv_dim = 1.0f / static_cast<float>(dim);
      float score = -INFINITY;
      if (lane < n) {
        float s = 0.0f, q = 0.0f;
        for (int r = 0; r < kCluster; ++r) {
          const float* remote = cluster.map_shared_rank(&part[parity][0], r);
          s += remote[lane];
          q += remote[kMax + lane];
        }
        score = q / sqrtf(s * inv_dim + p.eps);  // the rms factor scales the dot product once
      }
      const float max_score = cuda_util::warp_reduce(score, FMax{});
      const float e = lane < n ? expf(score - max_score) : 0.0f;
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) sum += __shfl_sync(0xffffffffu, e, i);
      if (lane < n) alpha[lane] = e / sum;
    }
    __syncthreads();
    bf16* ht = h + t * dim;
    float hss = 0.0f;
    for (int64_t v = v0 + threadIdx.x; v < v1; v += kCThreads) {
      const int64_t d = v * 8;
      float acc[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
#pragma unroll
      for (int i = 0; i < kMax; ++i) {
        if (i < n) {
          float val[8];
          load_vec<8>(base + i * cand_stride + d, val);
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[k] += alpha[i] * val[k];
        }
      }
      store_vec<8>(ht + d, acc);
      if constexpr (kNorm) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float hb = cuda_util::to_f32(cuda_util::to_bf16(acc[k]));
          hss += hb * hb;
        }
      }
    }
    if constexpr (kNorm) {
      hss = cuda_util::warp_reduce(hss, cuda_util::SumOp{});
      if (lane == 0) whss[warp] = hss;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < kCWarps; ++w) s += whss[w];
        hpart[parity] = s;
      }
      cluster.sync();
      float total = 0.0f;
      for (int r = 0; r < kCluster; ++r) total += *cluster.map_shared_rank(&hpart[parity], r);
      const float inv = 1.0f / sqrtf(total * (1.0f / static_cast<float>(dim)) + rms_eps);
      bf16* xt = x + t * dim;
      for (int64_t v = v0 + threadIdx.x; v < v1; v += kCThreads) {
        const int64_t d = v * 8;
        float val[8], w[8];
        load_vec<8>(ht + d, val);  // this thread's own stores
        load_vec<8>(rms_weight + d, w);
#pragma unroll
        for (int k = 0; k < 8; ++k) val[k] = w[k] * (val[k] * inv);
        store_vec<8>(xt + d, val);
      }
    }
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
}


// In launch<kNorm, kAdd>() the 16-byte path launched it instead of attn_res_kernel<8, kNorm, kAdd>:
//   const dim3 cgrid(kCluster, static_cast<unsigned>(std::min<int64_t>(p.n_tokens, 65535)));
//   attn_res_cluster_kernel<kNorm, kAdd><<<cgrid, kCThreads, 0, stream>>>(p, candidates, norm, proj, rms_weight,
//                                                                        rms_eps, h, x, addend, replace);
// (#include <cooperative_groups.h>; load_vec / store_vec / FMax / kMax as in attn_res_cuda.cu.)

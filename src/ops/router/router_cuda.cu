// CUDA router: one block of eight warps per token. Biased scores live in shared memory; group selection ranks groups
// exactly like the CPU's stable sort; the top-k (score desc, index asc, the CPU's partial_sort order) come from k
// rounds of a block argmax over each thread's own best (RouterTopk::kRounds, the default), or from sorting 64-bit keys
// that order the same way (kSort: each warp sorts its 128 experts and offers its best top_k, warp 0 sorts the
// offers). Sigmoid and the weight arithmetic use the same fp32 expressions as route_topk_cpu. A NaN score selects as
// the lowest finite value (as on the CPU) and every pick is a valid index, so corrupted logits never become an
// out-of-bounds read; the NaN weight reaches the logits, where the engine's per-step check fails the request.

#include "ops/router/router_cuda.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"

namespace bg::ops {
namespace {

constexpr int kWarps = 8;  // per token
constexpr int kThreads = kWarps * 32;
constexpr int kPerLane = 4;  // experts per lane in the first sort: kWarps * 32 * kPerLane = 1024 slots
static_assert(kRouterCudaMaxTopK <= 32);
static_assert(kWarps * 32 * kPerLane >= kRouterCudaMaxExperts);

struct RouterDims {
  int n_tokens, n_experts, top_k, n_group, topk_group;
  bool renormalize;
  float scaling_factor;
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Whether (va, ia) comes before (vb, ib) in the CPU order: larger score first, then lower index.
__device__ __forceinline__ bool before(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// A key that orders like the CPU, larger first: the score's bits made order-preserving above, the index reversed below
// (the lower index wins a tie). Scores are never NaN here (NaN became -FLT_MAX); -0 is keyed as +0, which it equals.
__device__ __forceinline__ uint64_t order_key(float v, int i) {
  uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
  u = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

// Bitonic sort of the warp's 32 * P keys into descending order; lane l holds ranks l * P .. l * P + P - 1 (blocked),
// so partners closer than P are in the lane's own registers and the others one shuffle away.
template <int P>
__device__ __forceinline__ void warp_sort_desc(uint64_t (&key)[P], int lane) {
  constexpr int kN = 32 * P;
#pragma unroll
  for (int k = 2; k <= kN; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int i = lane * P + p;
        const bool desc = (i & k) == 0;  // this run of k sorts descending, the next ascending
        if (j < P) {
          const int q = p ^ j;
          if (q > p && (key[p] < key[q]) == desc) {
            const uint64_t t = key[p];
            key[p] = key[q];
            key[q] = t;
          }
        } else {
          const uint64_t other = __shfl_xor_sync(0xffffffffu, key[p], j / P);
          const bool keep_larger = ((i & j) == 0) == desc;  // the lower of the pair keeps the larger when descending
          key[p] = keep_larger ? (key[p] > other ? key[p] : other) : (key[p] < other ? key[p] : other);
        }
      }
    }
  }
}

// Group stage: group score = top-2 sum of the biased scores (top-1 for groups of one); groups ranked by a stable
// descending sort; the experts of groups ranked >= topk_group get biased score 0.0 (transformers' mask).
__device__ void mask_losing_groups(const RouterDims& d, float* choice, float* group_score, int lane) {
  const int per_group = d.n_experts / d.n_group;
  for (int g = lane; g < d.n_group; g += 32) {
    const float* c = choice + g * per_group;
    float best = -INFINITY, second = -INFINITY;
    for (int i = 0; i < per_group; ++i) {  // the CPU's exact scan, so equal values give the same sums
      if (c[i] > best) {
        second = best;
        best = c[i];
      } else if (c[i] > second) {
        second = c[i];
      }
    }
    group_score[g] = per_group >= 2 ? best + second : best;
  }
  __syncwarp();
  // Rank of group g in a stable descending sort = number of groups that sort before it (O(n_group^2), n_group is
  // small: 8 for DeepSeek-V3).
  for (int g0 = 0; g0 < d.n_group; g0 += 32) {
    const int g = g0 + lane;
    int rank = 0;
    if (g < d.n_group) {
      for (int h = 0; h < d.n_group; ++h) rank += before(group_score[h], h, group_score[g], g) ? 1 : 0;
    }
    __syncwarp();
    if (g < d.n_group && rank >= d.topk_group) {
      for (int i = 0; i < per_group; ++i) choice[g * per_group + i] = 0.0f;
    }
    __syncwarp();
  }
}

// grid n_tokens, block kThreads (kWarps warps for one token), dynamic shared memory 2 n_experts + n_group floats.
// kSort: the top-k by sorting keys (RouterTopk::kSort), else by k rounds of a block argmax (kRounds).
template <bool kSort>
__global__ void __launch_bounds__(kThreads) route_topk_kernel(RouterDims d, const float* logits, const float* bias,
                                                              int32_t* expert_ids, float* weights) {
  extern __shared__ float smem[];
  __shared__ int picks[kRouterCudaMaxTopK];
  __shared__ float cand_v[2][kWarps];  // rounds: each warp's best of the round, double-buffered by round parity
  __shared__ int cand_i[2][kWarps];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int t = static_cast<int>(blockIdx.x);
  float* choice = smem;
  float* unbiased = choice + d.n_experts;  // sigmoid(logit): the weight of a pick
  float* group_score = unbiased + d.n_experts;
  const float* row = logits + static_cast<int64_t>(t) * d.n_experts;

  for (int e = tid; e < d.n_experts; e += kThreads) {
    const float s = sigmoid(row[e]);
    const float c = s + (bias ? bias[e] : 0.0f);
    unbiased[e] = s;
    choice[e] = isnan(c) ? -FLT_MAX : c;
  }
  __syncthreads();
  if (d.n_group > 1 && d.topk_group < d.n_group) {
    if (warp == 0) mask_losing_groups(d, choice, group_score, lane);
    __syncthreads();
  }

  if constexpr (kSort) {
    // Top-k by sorting keys that order like the CPU (score desc, then index asc): each warp sorts 32 * kPerLane slots
    // (bitonic, in registers and shuffles) and offers its best top_k, then warp 0 sorts the kWarps * 32 offers. (k
    // rounds of a block argmax took 9.6 us for top-16 of 896 on the H200; one warp with 28 experts a lane 15.2.)
    __shared__ uint64_t offers[kWarps * 32];
    {
      uint64_t key[kPerLane];
#pragma unroll
      for (int p = 0; p < kPerLane; ++p) {
        const int e = (warp * 32 + lane) * kPerLane + p;
        key[p] = e < d.n_experts ? order_key(choice[e], e) : 0;  // 0 sorts after every real key
      }
      warp_sort_desc<kPerLane>(key, lane);
#pragma unroll
      for (int p = 0; p < kPerLane; ++p) {
        const int rank = lane * kPerLane + p;
        if (rank < 32) offers[warp * 32 + rank] = rank < d.top_k ? key[p] : 0;
      }
    }
    __syncthreads();
    if (warp == 0) {
      constexpr int kOffersPerLane = kWarps;  // kWarps * 32 offers over 32 lanes
      uint64_t key[kOffersPerLane];
#pragma unroll
      for (int p = 0; p < kOffersPerLane; ++p) key[p] = offers[lane * kOffersPerLane + p];
      warp_sort_desc<kOffersPerLane>(key, lane);
#pragma unroll
      for (int p = 0; p < kOffersPerLane; ++p) {
        const int rank = lane * kOffersPerLane + p;
        if (rank < d.top_k) {
          const int e = static_cast<int>(0xffffffffu - static_cast<uint32_t>(key[p]));
          picks[rank] = e >= 0 && e < d.n_experts ? e : 0;  // unreachable otherwise (top_k <= n_experts real keys)
        }
      }
    }
  } else {
    // k rounds of argmax over the block; the winner is marked -inf so it is not taken again. Each thread keeps the best
    // of its own experts (e = tid mod kThreads, lowest index among equals); a round reduces those in each warp, then
    // over the warps, and only the thread that owns the winner rescans its experts. (One warp per token did the same
    // with 28 experts a lane and a 28-long rescan: 15.2 us for top-16 of 896 on the H200; four warps 10.8, eight 9.6.)
    auto own_best = [&](float& v, int& i) {
      v = -INFINITY;
      i = 0x7fffffff;
      for (int e = tid; e < d.n_experts; e += kThreads) {
        const float c = choice[e];
        if (c > v) {  // ascending e: strict > keeps the lowest index among equals
          v = c;
          i = e;
        }
      }
    };
    float own_v;
    int own_i;
    own_best(own_v, own_i);
    for (int k = 0; k < d.top_k; ++k) {
      float best_v = own_v;
      int best_i = own_i;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best_v, off);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, off);
        if (before(ov, oi, best_v, best_i)) {
          best_v = ov;
          best_i = oi;
        }
      }
      const int buf = k & 1;
      if (lane == 0) {
        cand_v[buf][warp] = best_v;
        cand_i[buf][warp] = best_i;
      }
      __syncthreads();  // (the other buffer is free: every thread passed this barrier after reading it last round)
      best_v = cand_v[buf][0];
      best_i = cand_i[buf][0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        if (before(cand_v[buf][w], cand_i[buf][w], best_v, best_i)) {
          best_v = cand_v[buf][w];
          best_i = cand_i[buf][w];
        }
      }
      if (best_i >= d.n_experts) best_i = 0;  // unreachable (top_k <= n_experts and picks are -inf, never NaN)
      if (tid == 0) picks[k] = best_i;
      if (tid == best_i % kThreads) {
        choice[best_i] = -INFINITY;
        own_best(own_v, own_i);
      }
    }
  }
  __syncthreads();
  if (warp != 0) return;
  int my_id = 0;
  float my_score = 0.0f;
  if (lane < d.top_k) {
    my_id = picks[lane];
    my_score = unbiased[my_id];
  }
  // Renormalise with the CPU's sequential sum order, then scale.
  float sum = 0.0f;
  for (int k = 0; k < d.top_k; ++k) sum += __shfl_sync(0xffffffffu, my_score, k);
  if (lane < d.top_k) {
    float w = my_score;
    if (d.renormalize) w /= (sum + 1e-20f);
    const int64_t idx = static_cast<int64_t>(t) * d.top_k + lane;
    expert_ids[idx] = my_id;
    weights[idx] = w * d.scaling_factor;
  }
}

}  // namespace

RouterTopk router_topk_from_env(const char* env_value) {
  return env_choice("BG_ROUTER_TOPK", env_value, {"rounds", "sort"}) == 0 ? RouterTopk::kRounds : RouterTopk::kSort;
}

RouterTopk router_topk_default() {
  static const RouterTopk algo = router_topk_from_env(std::getenv("BG_ROUTER_TOPK"));
  return algo;
}

void route_topk_cuda(const RouterParams& p, const float* logits, const float* bias, int32_t* expert_ids,
                     float* weights, cudaStream_t stream, std::optional<RouterTopk> algo) {
  BG_CHECK(p.n_experts > 0 && p.n_experts <= kRouterCudaMaxExperts, "route_topk_cuda: {} experts (1..{} supported)",
           p.n_experts, kRouterCudaMaxExperts);
  BG_CHECK(p.top_k > 0 && p.top_k <= p.n_experts && p.top_k <= kRouterCudaMaxTopK,
           "route_topk_cuda: top_k {} of {} experts (at most {})", p.top_k, p.n_experts, kRouterCudaMaxTopK);
  BG_CHECK(p.n_group > 0 && p.n_experts % p.n_group == 0 && p.topk_group >= 1 && p.topk_group <= p.n_group,
           "route_topk_cuda: {} experts in {} groups, keep {}", p.n_experts, p.n_group, p.topk_group);
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens <= INT32_MAX, "route_topk_cuda: n_tokens {}", p.n_tokens);
  if (p.n_tokens == 0) return;
  BG_CHECK(logits && expert_ids && weights, "route_topk_cuda: null pointer with {} tokens", p.n_tokens);
  const RouterDims d{static_cast<int>(p.n_tokens), static_cast<int>(p.n_experts), static_cast<int>(p.top_k),
                     static_cast<int>(p.n_group), static_cast<int>(p.topk_group), p.renormalize, p.scaling_factor};
  const size_t smem = sizeof(float) * static_cast<size_t>(2 * p.n_experts + p.n_group);
  const auto grid = static_cast<unsigned>(p.n_tokens);
  if (algo.value_or(router_topk_default()) == RouterTopk::kSort) {
    route_topk_kernel<true><<<grid, kThreads, smem, stream>>>(d, logits, bias, expert_ids, weights);
  } else {
    route_topk_kernel<false><<<grid, kThreads, smem, stream>>>(d, logits, bias, expert_ids, weights);
  }
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

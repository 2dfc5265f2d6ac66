// MoE dispatch on the device (counts, offsets, stable permutation from the router's ids), gather into expert order,
// weighted combine back to token order, the workspace layout, and the whole routed path.


#include <algorithm>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "moe/moe_cuda.h"

namespace bg {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kRowThreads = 128;  // gather / combine: one block per row or token
constexpr int64_t kMaxTopK = 32;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

int64_t n_chunks(const MoeCudaParams& p) {
  return (p.n_tokens * p.top_k + kMoeDispatchChunk - 1) / kMoeDispatchChunk;
}

// Every part of the workspace, in order, at `base` (0 when only the size is wanted).
MoeWorkspace layout_at(const MoeCudaParams& p, uintptr_t base, size_t* total) {
  const int64_t E = p.n_experts, slots = p.n_tokens * p.top_k;
  size_t off = 0;
  auto take = [&](auto*& ptr, int64_t count) {
    using T = std::remove_reference_t<decltype(*ptr)>;
    ptr = reinterpret_cast<T*>(base + off);
    off += align256(static_cast<size_t>(count) * sizeof(T));
  };
  MoeWorkspace ws;
  take(ws.counts, E);
  take(ws.offsets, E + 1);
  take(ws.tile_offsets, E + 1);
  take(ws.active, E);
  take(ws.n_active, 1);
  take(ws.chunk_base, n_chunks(p) * E);
  take(ws.slot_rank, slots);
  take(ws.row_token, slots);
  take(ws.row_weight, slots);
  take(ws.slot_row, slots);
  take(ws.x_perm, slots * p.hidden);
  take(ws.h, slots * p.inter);
  take(ws.y_perm, slots * p.hidden);
  *total = off;
  return ws;
}

// Exclusive prefix of v over the kScanThreads threads of the block, in thread order; `total` gets the block sum.
// s_warp: 32 ints of shared memory. Every thread of the block must call it.
__device__ int block_exclusive_scan(int v, int* s_warp, int& total) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  int incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int o = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += o;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = s_warp[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += o;
    }
    s_warp[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int prefix = (warp > 0 ? s_warp[warp - 1] : 0) + incl - v;
  total = s_warp[31];
  __syncthreads();  // s_warp is reused by the next call
  return prefix;
}

// Block c ranks slots [256 c, 256 c + 256): slot_rank[i] = earlier slots of the chunk with the same expert (stable),
// chunk_base[c, e] = the chunk's slots of expert e (turned into a prefix by the scan kernel). Dynamic smem: E ints.
__global__ void __launch_bounds__(kMoeDispatchChunk) dispatch_rank_kernel(const int32_t* ids, int n_slots, int E,
                                                                         MoeWorkspace ws) {
  __shared__ int s_ids[kMoeDispatchChunk];
  extern __shared__ int hist[];
  const int tid = static_cast<int>(threadIdx.x);
  const int i = static_cast<int>(blockIdx.x) * kMoeDispatchChunk + tid;
  int e = -1;
  if (i < n_slots) {
    e = ids[i];
    if (e < 0 || e >= E) __trap();  // corrupted routing: fail loudly rather than drop the slot
  }
  s_ids[tid] = e;
  for (int j = tid; j < E; j += kMoeDispatchChunk) hist[j] = 0;
  __syncthreads();
  if (e >= 0) {
    int rank = 0;
    for (int j = 0; j < tid; ++j) rank += s_ids[j] == e ? 1 : 0;  // broadcast reads of shared memory
    ws.slot_rank[i] = rank;
    atomicAdd(&hist[e], 1);  // counts do not depend on the order of the atomics
  }
  __syncthreads();
  for (int j = tid; j < E; j += kMoeDispatchChunk) ws.chunk_base[static_cast<int64_t>(blockIdx.x) * E + j] = hist[j];
}

// One block of 1024 threads: per-expert prefix over chunks (chunk_base), counts, offsets, tile offsets, active list.
__global__ void __launch_bounds__(kScanThreads) dispatch_scan_kernel(int E, int chunks, MoeWorkspace ws) {
  __shared__ int s_warp[32];
  const int tid = static_cast<int>(threadIdx.x);
  for (int e = tid; e < E; e += kScanThreads) {
    int run = 0;
    for (int c = 0; c < chunks; ++c) {
      int* cell = ws.chunk_base + static_cast<int64_t>(c) * E + e;
      const int v = *cell;
      *cell = run;
      run += v;
    }
    ws.counts[e] = run;
  }
  __syncthreads();
  // Thread tid owns experts [lo, hi) so that a thread-order scan is an expert-order scan.
  const int per = (E + kScanThreads - 1) / kScanThreads;
  const int lo = min(E, tid * per), hi = min(E, lo + per);
  int rows = 0, tiles = 0, act = 0;
  for (int e = lo; e < hi; ++e) {
    const int c = ws.counts[e];
    rows += c;
    tiles += (c + kMoeTileRows - 1) / kMoeTileRows;
    act += c > 0 ? 1 : 0;
  }
  int total_rows, total_tiles, total_act;
  int r = block_exclusive_scan(rows, s_warp, total_rows);
  int t = block_exclusive_scan(tiles, s_warp, total_tiles);
  int a = block_exclusive_scan(act, s_warp, total_act);
  for (int e = lo; e < hi; ++e) {
    const int c = ws.counts[e];
    ws.offsets[e] = r;
    ws.tile_offsets[e] = t;
    if (c > 0) ws.active[a++] = e;
    r += c;
    t += (c + kMoeTileRows - 1) / kMoeTileRows;
  }
  if (tid == 0) {
    ws.offsets[E] = total_rows;
    ws.tile_offsets[E] = total_tiles;
    *ws.n_active = total_act;
  }
}

// slot i = (token i / k, slot i % k) goes to permuted row offsets[e] + (earlier chunks' rows of e) + rank in chunk.
__global__ void dispatch_scatter_kernel(const int32_t* ids, const float* weights, int n_slots, int top_k, int E,
                                        MoeWorkspace ws) {
  const int i = static_cast<int>(blockIdx.x) * blockDim.x + static_cast<int>(threadIdx.x);
  if (i >= n_slots) return;
  const int e = ids[i];
  const int c = i / kMoeDispatchChunk;
  const int row = ws.offsets[e] + ws.chunk_base[static_cast<int64_t>(c) * E + e] + ws.slot_rank[i];
  ws.row_token[row] = i / top_k;
  ws.row_weight[row] = weights[i];
  ws.slot_row[i] = row;
}

// grid n_slots: x_perm[row] = x[row_token[row]].
__global__ void __launch_bounds__(kRowThreads) gather_kernel(const __nv_bfloat16* x, int64_t hidden, MoeWorkspace ws) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* src = x + static_cast<int64_t>(ws.row_token[row]) * hidden;
  __nv_bfloat16* dst = ws.x_perm + row * hidden;
  if (hidden % 8 == 0) {
    for (int64_t s = threadIdx.x; s < hidden / 8; s += kRowThreads)
      reinterpret_cast<uint4*>(dst)[s] = __ldg(reinterpret_cast<const uint4*>(src) + s);
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += kRowThreads) dst[i] = src[i];
  }
}

// grid n_tokens: out[t] = (accumulate ? out[t] : 0) + sum_k w * y_perm[slot_row[t, k]], fp32, slot order.
__global__ void __launch_bounds__(kRowThreads) combine_kernel(int top_k, int64_t hidden, bool out_f32,
                                                              bool accumulate, MoeWorkspace ws, void* out) {
  __shared__ int s_row[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  const int64_t t = blockIdx.x;
  if (static_cast<int>(threadIdx.x) < top_k) {
    const int row = ws.slot_row[t * top_k + threadIdx.x];
    s_row[threadIdx.x] = row;
    s_w[threadIdx.x] = ws.row_weight[row];
  }
  __syncthreads();
  auto* out_f = static_cast<float*>(out) + t * hidden;
  auto* out_b = static_cast<__nv_bfloat16*>(out) + t * hidden;
  // Each thread owns whole groups of kVec consecutive elements (kVec = 8 with 16-byte loads when hidden % 8 == 0).
  auto run = [&](auto vec_tag) {
    constexpr int kVec = decltype(vec_tag)::value;
    for (int64_t i0 = threadIdx.x * kVec; i0 < hidden; i0 += kRowThreads * kVec) {
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        acc[j] = !accumulate ? 0.0f : out_f32 ? out_f[i0 + j] : __bfloat162float(out_b[i0 + j]);
      for (int k = 0; k < top_k; ++k) {
        const __nv_bfloat16* y = ws.y_perm + static_cast<int64_t>(s_row[k]) * hidden + i0;
        __align__(16) __nv_bfloat16 yv[kVec];
        if constexpr (kVec == 8) {
          *reinterpret_cast<uint4*>(yv) = __ldg(reinterpret_cast<const uint4*>(y));
        } else {
          yv[0] = y[0];
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[j] = fmaf(s_w[k], __bfloat162float(yv[j]), acc[j]);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (out_f32) {
          out_f[i0 + j] = acc[j];
        } else {
          out_b[i0 + j] = __float2bfloat16(acc[j]);
        }
      }
    }
  };
  if (hidden % 8 == 0) {
    run(std::integral_constant<int, 8>{});
  } else {
    run(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void moe_check_params(const MoeCudaParams& p) {
  BG_CHECK(p.n_tokens >= 0, "moe_cuda: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_experts > 0 && p.n_experts <= kMoeMaxExperts, "moe_cuda: {} experts (1..{} supported)", p.n_experts,
           kMoeMaxExperts);
  BG_CHECK(p.top_k > 0 && p.top_k <= kMaxTopK && p.top_k <= p.n_experts, "moe_cuda: top_k {} of {} experts (<= {})",
           p.top_k, p.n_experts, kMaxTopK);
  BG_CHECK(p.hidden > 0 && p.inter > 0, "moe_cuda: hidden {} and inter {} must be positive", p.hidden, p.inter);
  BG_CHECK(p.n_tokens * p.top_k <= INT32_MAX, "moe_cuda: {} tokens x top-{} overflow 32-bit row indices", p.n_tokens,
           p.top_k);
  BG_CHECK(p.expert_format != WeightFormat::kMxfp4 || (p.hidden % kMxfp4GroupSize == 0 &&
                                                       p.inter % kMxfp4GroupSize == 0),
           "moe_cuda: MXFP4 experts need hidden {} and inter {} to be multiples of 32", p.hidden, p.inter);
  BG_CHECK(p.act.kind != GluActivation::kSiTU || (p.act.beta > 0.0f && p.act.beta_lin > 0.0f),
           "moe_cuda: SiTU beta {} and beta_lin {} must be positive", p.act.beta, p.act.beta_lin);
}

size_t moe_workspace_bytes(const MoeCudaParams& p) {
  moe_check_params(p);
  size_t total = 0;
  layout_at(p, 0, &total);
  return total;
}

MoeWorkspace moe_workspace_layout(const MoeCudaParams& p, void* base) {
  moe_check_params(p);
  BG_CHECK(base != nullptr && reinterpret_cast<uintptr_t>(base) % 256 == 0,
           "moe_workspace_layout: base {} must be non-null and 256-byte aligned", base);
  size_t total = 0;
  return layout_at(p, reinterpret_cast<uintptr_t>(base), &total);
}

void moe_dispatch_cuda(const MoeCudaParams& p, const int32_t* expert_ids, const float* weights, const MoeWorkspace& ws,
                       cudaStream_t stream) {
  moe_check_params(p);
  const int slots = static_cast<int>(p.n_tokens * p.top_k), E = static_cast<int>(p.n_experts);
  const int chunks = static_cast<int>(n_chunks(p));
  if (slots > 0) {
    BG_CHECK(expert_ids && weights, "moe_dispatch_cuda: null ids or weights with {} tokens", p.n_tokens);
    dispatch_rank_kernel<<<chunks, kMoeDispatchChunk, sizeof(int) * static_cast<size_t>(E), stream>>>(expert_ids,
                                                                                                      slots, E, ws);
    BG_CUDA_CHECK_LAUNCH();
  }
  // Runs for 0 tokens too, so that counts / offsets / n_active read as empty.
  dispatch_scan_kernel<<<1, kScanThreads, 0, stream>>>(E, chunks, ws);
  BG_CUDA_CHECK_LAUNCH();
  if (slots > 0) {
    dispatch_scatter_kernel<<<(slots + 255) / 256, 256, 0, stream>>>(expert_ids, weights, slots,
                                                                      static_cast<int>(p.top_k), E, ws);
    BG_CUDA_CHECK_LAUNCH();
  }
}

void moe_gather_cuda(const MoeCudaParams& p, const __nv_bfloat16* x, const MoeWorkspace& ws, cudaStream_t stream) {
  moe_check_params(p);
  const int64_t slots = p.n_tokens * p.top_k;
  if (slots == 0) return;
  BG_CHECK(x != nullptr, "moe_gather_cuda: null x with {} tokens", p.n_tokens);
  gather_kernel<<<static_cast<unsigned>(slots), kRowThreads, 0, stream>>>(x, p.hidden, ws);
  BG_CUDA_CHECK_LAUNCH();
}

void moe_combine_cuda(const MoeCudaParams& p, const MoeWorkspace& ws, void* out, cudaStream_t stream) {
  moe_check_params(p);
  if (p.n_tokens == 0) return;
  BG_CHECK(out != nullptr, "moe_combine_cuda: null out with {} tokens", p.n_tokens);
  combine_kernel<<<static_cast<unsigned>(p.n_tokens), kRowThreads, 0, stream>>>(
      static_cast<int>(p.top_k), p.hidden, p.out_type == MoeOutType::kF32, p.accumulate, ws, out);
  BG_CUDA_CHECK_LAUNCH();
}

void moe_routed_experts_cuda(const MoeCudaParams& p, const MoeCudaArgs& a, const MoeWorkspace& ws,
                             cudaStream_t stream) {
  moe_dispatch_cuda(p, a.expert_ids, a.weights, ws, stream);
  moe_gather_cuda(p, a.x, ws, stream);
  moe_expert_ffn_cuda(p, a.experts, ws, stream);
  moe_combine_cuda(p, ws, a.out, stream);
}

}  // namespace bg

// MoE dispatch on the device (per-slot counts, offsets and a stable permutation from the router's ids through the
// expert -> slot map), gather into slot order, and the weighted combine back to token order. A stable counting sort:
// (1) each 256-pair chunk ranks its pairs per slot and histograms them, (2) a block per slot turns its chunk histograms
// into prefixes and its count, then one block makes offsets, tile offsets and the active list, (3) each pair lands at
// offsets[slot] + (its chunk's base for the slot) + (its rank in the chunk). Up to 1024 pairs (a decode step) it all
// runs as one block in one launch. No host reads anywhere, so the whole routed path can be captured in a CUDA graph.

#include <algorithm>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/moe/moe_cuda.h"

namespace bg::ops {
namespace {

constexpr int kScanThreads = 1024;
constexpr int kRowThreads = 128;  // gather / combine: one block per row or token

// Whether token t is a padding row (MoeWorkspace::live_tokens).
__device__ __forceinline__ bool padding_token(int t, const MoeWorkspace& ws) {
  return ws.live_tokens != nullptr && ws.live_row0 + t >= *ws.live_tokens;
}

// The pair's local slot: -1 when its expert lives on another rank or its token is padding; -1 and an error flag when
// the id is out of range (a corrupted routing is reported, never used as an index).
__device__ __forceinline__ int slot_of_pair(const int32_t* ids, int i, int top_k, int n_experts, bool all_local,
                                            const MoeWorkspace& ws) {
  if (padding_token(i / top_k, ws)) return -1;
  const int e = ids[i];
  if (e < 0 || e >= n_experts) {
    atomicOr(ws.error_flags, kMoeErrorBadExpertId);
    return -1;
  }
  const int slot = ws.slot_map[e];
  if (slot < 0 && all_local) atomicOr(ws.error_flags, kMoeErrorNoSlot);
  return slot;
}

// Exclusive prefix of v over the kScanThreads threads of the block (cuda_util::block_exclusive_scan); `total` gets
// the block sum. s_warp: 32 ints of shared memory. Every thread of the block must call it.
__device__ __forceinline__ int block_exclusive_scan(int v, int* s_warp, int& total) {
  return cuda_util::block_exclusive_scan<kScanThreads>(v, s_warp, &total);
}

// From ws.counts (complete, visible to the block): offsets, tile offsets, the active list and n_active, by the
// kScanThreads threads of one block (every thread must call it).
__device__ void scan_counts(int E, const MoeWorkspace& ws, int* s_warp) {
  const int tid = static_cast<int>(threadIdx.x);
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

// Block c ranks pairs [256 c, 256 c + 256): pair_rank[i] = earlier pairs of the chunk with the same slot (stable),
// chunk_base[s, c] = the chunk's pairs of slot s (turned into a prefix by the scan kernel; slot-major, so a slot's
// chunks are contiguous for the scan). Dynamic smem: E ints (E = local slots).
__global__ void __launch_bounds__(kMoeDispatchChunk) dispatch_rank_kernel(const int32_t* ids, int n_pairs, int top_k,
                                                                         int n_experts, int E, bool all_local,
                                                                         MoeWorkspace ws) {
  __shared__ int s_ids[kMoeDispatchChunk];
  extern __shared__ int hist[];
  const int tid = static_cast<int>(threadIdx.x);
  const int i = static_cast<int>(blockIdx.x) * kMoeDispatchChunk + tid;
  const int e = i < n_pairs ? slot_of_pair(ids, i, top_k, n_experts, all_local, ws) : -1;
  s_ids[tid] = e;
  for (int j = tid; j < E; j += kMoeDispatchChunk) hist[j] = 0;
  __syncthreads();
  if (e >= 0) {
    int rank = 0;
    for (int j = 0; j < tid; ++j) rank += s_ids[j] == e ? 1 : 0;  // broadcast reads of shared memory
    ws.pair_rank[i] = rank;
    atomicAdd(&hist[e], 1);  // counts do not depend on the order of the atomics
  }
  __syncthreads();
  for (int j = tid; j < E; j += kMoeDispatchChunk) {
    ws.chunk_base[static_cast<int64_t>(j) * gridDim.x + blockIdx.x] = hist[j];
  }
}

// Block s of E: slot s's prefix over its (contiguous) chunk counts, kScanThreads chunks at a time, and its count.
// A block per slot, so the E slots' scans run on E SMs: one block walking every slot's chunks was bound by one SM's
// L2 traffic (88 us at 16k tokens of K3). Integers: the same values as a walk in chunk order.
__global__ void __launch_bounds__(kScanThreads) dispatch_scan_kernel(int chunks, MoeWorkspace ws) {
  __shared__ int s_warp[32];
  const int tid = static_cast<int>(threadIdx.x), e = static_cast<int>(blockIdx.x);
  int* row = ws.chunk_base + static_cast<int64_t>(e) * chunks;
  int carry = 0;
  for (int base = 0; base < chunks; base += kScanThreads) {  // uniform trip count: every thread scans
    const int c = base + tid;
    const int v = c < chunks ? row[c] : 0;
    int total = 0;
    const int prefix = block_exclusive_scan(v, s_warp, total);
    if (c < chunks) row[c] = carry + prefix;
    carry += total;
  }
  if (tid == 0) ws.counts[e] = carry;
}

// One block: offsets, tile offsets and the active list from the counts.
__global__ void __launch_bounds__(kScanThreads) dispatch_counts_kernel(int E, MoeWorkspace ws) {
  __shared__ int s_warp[32];
  scan_counts(E, ws, s_warp);
}

// A step of at most kSmallChunks chunks (decode: 64 tokens x top-16) in one block of kScanThreads: the rank, scan and
// scatter kernels' work with the same results (counts, offsets, tile offsets, active list, chunk prefixes, rows), in
// one launch instead of three. Dynamic smem: kSmallChunks * E ints (per-chunk histograms, then prefixes).
constexpr int kSmallChunks = kScanThreads / kMoeDispatchChunk;

__global__ void __launch_bounds__(kScanThreads) dispatch_small_kernel(const int32_t* ids, const float* weights,
                                                                      int n_pairs, int top_k, int n_experts, int E,
                                                                      bool all_local, MoeWorkspace ws) {
  __shared__ int s_warp[32];
  extern __shared__ int hist[];  // [kSmallChunks][E]
  const int tid = static_cast<int>(threadIdx.x), chunks = (n_pairs + kMoeDispatchChunk - 1) / kMoeDispatchChunk;
  const int e = tid < n_pairs ? slot_of_pair(ids, tid, top_k, n_experts, all_local, ws) : -1;
  const float w = tid < n_pairs ? weights[tid] : 0.0f;
  for (int j = tid; j < kSmallChunks * E; j += kScanThreads) hist[j] = 0;
  __syncthreads();
  // A pair's rank in its chunk (the chunk's earlier pairs of the same slot) and the chunk histograms: the chunks'
  // warps take turns (all chunks at once); in its turn a warp adds its lanes of slot e to hist[c][e], each lane's
  // rank being the count before its warp plus its earlier lanes of e (__match_any_sync). The same integers as a walk
  // over the chunk's pairs in order (it was one: up to 255 shared loads per thread in series, ~10 us per MoE layer
  // at 64 tokens with the rest of this kernel, H100).
  const int c = tid / kMoeDispatchChunk, chunk_warp = (tid % kMoeDispatchChunk) / 32, lane = tid & 31;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const unsigned below = peers & ((1u << lane) - 1u);
  int rank = 0;
  for (int turn = 0; turn < kMoeDispatchChunk / 32; ++turn) {
    if (turn == chunk_warp) {  // uniform over the warp
      const int before = e >= 0 ? hist[c * E + e] : 0;
      __syncwarp();
      if (e >= 0) {
        rank = before + __popc(below);
        if (below == 0) hist[c * E + e] = before + __popc(peers);  // one lane per slot
      }
    }
    __syncthreads();
  }
  // Per slot: the chunk histograms become prefixes over chunks; counts.
  for (int x = tid; x < E; x += kScanThreads) {
    int run = 0;
    for (int cc = 0; cc < chunks; ++cc) {
      const int v = hist[cc * E + x];
      hist[cc * E + x] = run;
      ws.chunk_base[static_cast<int64_t>(x) * chunks + cc] = run;
      run += v;
    }
    ws.counts[x] = run;
  }
  __syncthreads();
  scan_counts(E, ws, s_warp);
  __syncthreads();  // offsets are read back below by other threads
  if (tid >= n_pairs) return;
  if (e < 0) {
    ws.slot_row[tid] = -1;
    return;
  }
  ws.pair_rank[tid] = rank;
  const int row = ws.offsets[e] + hist[c * E + e] + rank;
  ws.row_token[row] = tid / top_k;
  ws.row_weight[row] = w;
  ws.slot_row[tid] = row;
}

// Pair i = (token i / k, k = i % k) goes to row offsets[s] + (earlier chunks' rows of s) + its rank in the chunk;
// pairs of other ranks' experts get slot_row -1.
__global__ void dispatch_scatter_kernel(const int32_t* ids, const float* weights, int n_pairs, int top_k,
                                        int n_experts, int E, MoeWorkspace ws) {
  const int i = static_cast<int>(blockIdx.x) * blockDim.x + static_cast<int>(threadIdx.x);
  if (i >= n_pairs) return;
  const int id = padding_token(i / top_k, ws) ? -1 : ids[i];
  const int e = id >= 0 && id < n_experts ? ws.slot_map[id] : -1;  // the rank kernel already flagged bad ids
  if (e < 0) {
    ws.slot_row[i] = -1;
    return;
  }
  const int c = i / kMoeDispatchChunk, chunks = (n_pairs + kMoeDispatchChunk - 1) / kMoeDispatchChunk;
  const int row = ws.offsets[e] + ws.chunk_base[static_cast<int64_t>(e) * chunks + c] + ws.pair_rank[i];
  ws.row_token[row] = i / top_k;
  ws.row_weight[row] = weights[i];
  ws.slot_row[i] = row;
}

// grid n_pairs (an upper bound of the rows): x_perm[row] = x[row_token[row]] for row < offsets[n_slots].
__global__ void __launch_bounds__(kRowThreads) gather_kernel(const __nv_bfloat16* x, int64_t hidden, int n_slots,
                                                             MoeWorkspace ws) {
  const int64_t row = blockIdx.x;
  if (row >= ws.offsets[n_slots]) return;  // whole block: rows of this rank are fewer than the pairs
  const __nv_bfloat16* src = x + static_cast<int64_t>(ws.row_token[row]) * hidden;
  __nv_bfloat16* dst = ws.x_perm + row * hidden;
  if (hidden % 8 == 0) {
    for (int64_t s = threadIdx.x; s < hidden / 8; s += kRowThreads)
      reinterpret_cast<uint4*>(dst)[s] = __ldg(reinterpret_cast<const uint4*>(src) + s);
  } else {
    for (int64_t i = threadIdx.x; i < hidden; i += kRowThreads) dst[i] = src[i];
  }
}

// grid n_tokens: out[t] = (accumulate ? out[t] : 0) + sum_k w * y_perm[slot_row[t, k]], fp32, k order; pairs of
// other ranks (slot_row -1) are left to the exchange.
__global__ void __launch_bounds__(kRowThreads) combine_kernel(int top_k, int64_t hidden, bool out_f32,
                                                              bool accumulate, MoeWorkspace ws, void* out) {
  __shared__ int s_row[kMoeMaxTopK];
  __shared__ float s_w[kMoeMaxTopK];
  __shared__ int s_n;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {  // the local pairs of token t, compacted in k order
    int n = 0;
    for (int k = 0; k < top_k; ++k) {
      const int row = ws.slot_row[t * top_k + k];
      if (row < 0) continue;
      s_row[n] = row;
      s_w[n] = ws.row_weight[row];
      ++n;
    }
    s_n = n;
  }
  __syncthreads();
  const int n_local = s_n;
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
      for (int k = 0; k < n_local; ++k) {
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
  moe_check_shape(p.shape);
  BG_CHECK(p.hidden > 0 && p.inter > 0, "moe_cuda: hidden {} and inter {} must be positive", p.hidden, p.inter);
  BG_CHECK(p.expert_format != WeightFormat::kMxfp4 || (p.hidden % kMxfp4GroupSize == 0 &&
                                                       p.inter % kMxfp4GroupSize == 0),
           "moe_cuda: MXFP4 experts need hidden {} and inter {} to be multiples of 32", p.hidden, p.inter);
  BG_CHECK(p.act.kind != MoeGlu::kSitu || (p.act.beta > 0.0f && p.act.beta_lin > 0.0f),
           "moe_cuda: SiTU beta {} and beta_lin {} must be positive", p.act.beta, p.act.beta_lin);
}

MoeDispatchBuffers::MoeDispatchBuffers(const MoeCudaParams& p, const std::vector<int32_t>& slot_map) {
  moe_check_params(p);
  const MoeRoutingShape& s = p.shape;
  std::vector<int32_t> map = slot_map;
  if (map.empty()) {
    map.resize(static_cast<size_t>(s.n_experts));
    for (size_t e = 0; e < map.size(); ++e) map[e] = static_cast<int32_t>(e);
  }
  BG_CHECK(static_cast<int64_t>(map.size()) == s.n_experts, "MoeDispatchBuffers: slot map of {} for {} experts",
           map.size(), s.n_experts);
  auto al = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t pairs = static_cast<size_t>(std::max<int64_t>(1, s.n_pairs()));
  const size_t routing = al(moe_routing_bytes(s)), map_b = al(map.size() * 4);
  const size_t xb = al(pairs * static_cast<size_t>(p.hidden) * 2), hb = al(pairs * static_cast<size_t>(p.inter) * 2);
  buf = cuda::DeviceBuffer(routing + map_b + 2 * xb + hb + 256);
  buf.fill_bytes(0xff);
  auto* base = buf.as<std::byte>();
  static_cast<MoeRoutingArrays&>(ws) = moe_routing_layout(s, base);
  BG_CUDA_CHECK(cudaMemcpy(base + routing, map.data(), map.size() * 4, cudaMemcpyHostToDevice));
  ws.slot_map = reinterpret_cast<const int32_t*>(base + routing);
  ws.x_perm = reinterpret_cast<__nv_bfloat16*>(base + routing + map_b);
  ws.y_perm = reinterpret_cast<__nv_bfloat16*>(base + routing + map_b + xb);
  ws.h = reinterpret_cast<__nv_bfloat16*>(base + routing + map_b + 2 * xb);
  ws.error_flags = reinterpret_cast<int32_t*>(base + routing + map_b + 2 * xb + hb);
  BG_CUDA_CHECK(cudaMemset(ws.error_flags, 0, sizeof(int32_t)));
}

int32_t MoeDispatchBuffers::error_word() const {
  int32_t v = 0;
  BG_CUDA_CHECK(cudaMemcpy(&v, ws.error_flags, sizeof(v), cudaMemcpyDeviceToHost));
  return v;
}

void moe_dispatch_cuda(const MoeCudaParams& p, const int32_t* expert_ids, const float* weights, const MoeWorkspace& ws,
                       cudaStream_t stream) {
  moe_check_params(p);
  BG_CHECK(ws.slot_map != nullptr && ws.error_flags != nullptr, "moe_dispatch_cuda: null slot map or error word");
  const int pairs = static_cast<int>(p.shape.n_pairs()), E = static_cast<int>(p.shape.n_slots);
  const int n_experts = static_cast<int>(p.shape.n_experts), chunks = static_cast<int>(p.shape.n_chunks());
  const size_t small_smem = sizeof(int) * static_cast<size_t>(kSmallChunks) * static_cast<size_t>(E);
  if (pairs > 0 && chunks <= kSmallChunks && small_smem <= 32 * 1024) {
    BG_CHECK(expert_ids && weights, "moe_dispatch_cuda: null ids or weights with {} tokens", p.shape.n_tokens);
    dispatch_small_kernel<<<1, kScanThreads, small_smem, stream>>>(expert_ids, weights, pairs,
                                                                   static_cast<int>(p.shape.top_k), n_experts, E,
                                                                   p.shape.all_local, ws);
    BG_CUDA_CHECK_LAUNCH();
    return;
  }
  if (pairs > 0) {
    BG_CHECK(expert_ids && weights, "moe_dispatch_cuda: null ids or weights with {} tokens", p.shape.n_tokens);
    dispatch_rank_kernel<<<chunks, kMoeDispatchChunk, sizeof(int) * static_cast<size_t>(E), stream>>>(
        expert_ids, pairs, static_cast<int>(p.shape.top_k), n_experts, E, p.shape.all_local, ws);
    BG_CUDA_CHECK_LAUNCH();
  }
  // Runs for 0 tokens too, so that counts / offsets / n_active read as empty.
  if (E > 0) {
    dispatch_scan_kernel<<<static_cast<unsigned>(E), kScanThreads, 0, stream>>>(chunks, ws);
    BG_CUDA_CHECK_LAUNCH();
  }
  dispatch_counts_kernel<<<1, kScanThreads, 0, stream>>>(E, ws);
  BG_CUDA_CHECK_LAUNCH();
  if (pairs > 0) {
    dispatch_scatter_kernel<<<(pairs + 255) / 256, 256, 0, stream>>>(expert_ids, weights, pairs,
                                                                      static_cast<int>(p.shape.top_k), n_experts, E,
                                                                      ws);
    BG_CUDA_CHECK_LAUNCH();
  }
}

void moe_gather_cuda(const MoeCudaParams& p, const __nv_bfloat16* x, const MoeWorkspace& ws, cudaStream_t stream) {
  moe_check_params(p);
  const int64_t pairs = p.shape.n_pairs();
  if (pairs == 0) return;
  BG_CHECK(x != nullptr, "moe_gather_cuda: null x with {} tokens", p.shape.n_tokens);
  gather_kernel<<<static_cast<unsigned>(pairs), kRowThreads, 0, stream>>>(x, p.hidden,
                                                                          static_cast<int>(p.shape.n_slots), ws);
  BG_CUDA_CHECK_LAUNCH();
}

void moe_combine_cuda(const MoeCudaParams& p, const MoeWorkspace& ws, void* out, cudaStream_t stream) {
  moe_check_params(p);
  if (p.shape.n_tokens == 0) return;
  BG_CHECK(out != nullptr, "moe_combine_cuda: null out with {} tokens", p.shape.n_tokens);
  combine_kernel<<<static_cast<unsigned>(p.shape.n_tokens), kRowThreads, 0, stream>>>(
      static_cast<int>(p.shape.top_k), p.hidden, p.out_type == MoeOutType::kF32, p.accumulate, ws, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

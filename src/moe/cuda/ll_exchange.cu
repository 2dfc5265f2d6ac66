// LlExchange: the low-latency expert exchange between CUDA ranks (DeepEP low-latency style) over the wire layout of
// ops/moe_exchange/moe_exchange.h, with bf16 rows (or FP8 E4M3 dispatch rows, ll-fp8) and 64-bit flags. Every rank
// owns one device region; the others address it through CUDA IPC (ranks on one GPU or on GPUs of one host; the
// regions, the shape and the rank-set factory are in ll_exchange_setup.cpp). Senders write rows straight into the
// receiver's fixed slots and then publish per-slot flags with system-scope release stores; receivers spin on their own
// flags with acquire loads. No host synchronisation anywhere, a fixed kernel sequence per call and a device-side epoch:
// the exchange is CUDA-graph capturable. A wait that outlives the rank timeout traps (the rank's context dies, the
// worker exits with a device fault and the set is restarted) instead of hanging.
//
// Per call (epoch e, buffers of parity e & 1), on the backend's stream:
//   begin_dispatch   plan (1 warp: each (token, k) pair's (rank, slot, index), stable in pair order)
//                    send (one block per pair: header + row (bf16, or FP8 codes + scales) into the owner's slot; the
//                    last block to finish publishes every (rank, slot) flag this rank owes, counts included, zeros too)
//   finish_dispatch  wait (1 block: every (slot, source) flag of this rank, the routing arrays by slot)
//                    unpack (rows packed by slot, then source rank, then arrival; origin of each row)
//   begin_combine    return (each expert output row to the combine row (t * top_k + k) of its sender; the last block
//                    publishes this rank's combine flag on every rank)
//   finish_combine   reduce (out[t] = bf16(out[t] + sum_k w y) in k order with fmaf, the loopback's arithmetic; the
//                    last block advances the epoch)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "core/log.h"
#include "moe/cuda_exchange.h"
#include "ops/moe/fp8_block_device.cuh"
#include "ops/moe/moe_cuda.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::moe {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kThreads = 256;

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("ll exchange: CUDA {}: {}", what, cudaGetErrorString(e));
}

// What every kernel of one exchange knows (by value).
struct LlGeo {
  int n_ranks = 1, n_local = 1, max_tokens = 1, top_k = 1, hidden = 0;
  bool fp8 = false;  // dispatch rows as FP8 E4M3 codes [hidden] then one fp32 scale per 128 values
  int rank = 0, n_experts = 0, n_local_here = 0;
  size_t msg_bytes = 0, combine_row_bytes = 0;
  size_t dispatch_slots[2] = {}, dispatch_flags[2] = {}, combine_rows[2] = {}, combine_flags[2] = {};
  unsigned long long timeout_ns = 0;
};

// The exchange's device memory (pointers into one allocation, except the regions and the error word).
struct LlDev {
  std::byte* const* peers = nullptr;  // [n_ranks] every rank's region as this process addresses it
  const int32_t* owner = nullptr;     // [n_experts]
  const int32_t* slot = nullptr;      // [n_experts]
  uint32_t* epoch = nullptr;          // current epoch (starts at 1; advanced by the last reduce block)
  uint32_t* done = nullptr;           // [3] block arrival counters (send, return, reduce); zero between calls
  int32_t* pair_msg = nullptr;        // [max_tokens * top_k] bucket * max_tokens + index, -1: not sent
  int32_t* bucket_count = nullptr;    // [n_ranks * n_local] rows this rank sends to (rank, slot)
  int32_t* recv_base = nullptr;       // [n_local_here * n_ranks + 1] first packed row of (slot, source)
  int32_t* error_flags = nullptr;     // the backend's kernel error word (ops/moe/moe_cuda.h bits)
  const volatile uint32_t* abort = nullptr;  // host-mapped: set by the watchdog when a peer is gone
};

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long flag_value(uint32_t epoch, int count) {
  return (static_cast<unsigned long long>(epoch) << 32) | static_cast<uint32_t>(count + 1);
}

// Spins until the flag carries `epoch`. Traps (the rank's context is lost, its worker exits and the set restarts)
// when the watchdog saw a peer go, or past the timeout: a wait never outlives the rank set.
__device__ unsigned long long wait_flag(const unsigned long long* f, uint32_t epoch, const LlGeo& g, const LlDev& d,
                                        int peer, const char* what) {
  const unsigned long long t0 = now_ns();
  for (unsigned spins = 1;; ++spins) {
    const unsigned long long v = load_acquire_sys(f);
    if (static_cast<uint32_t>(v >> 32) == epoch) return v;
    if ((spins & 15u) == 0 && *d.abort != 0) {
      printf("batchgen ll exchange: rank %d stops waiting for rank %d (%s, epoch %u): a rank of the set is gone\n",
             g.rank, peer, what, epoch);
      __trap();
    }
    if (now_ns() - t0 > g.timeout_ns) {
      printf("batchgen ll exchange: rank %d waited %.0f s for rank %d (%s, epoch %u); the set is failed\n", g.rank,
             static_cast<double>(g.timeout_ns) * 1e-9, peer, what, epoch);
      __trap();
    }
    __nanosleep(128);
  }
}

// True in exactly one block: the last of the grid to arrive at counter `c` (which it resets). Every block's earlier
// writes are visible system-wide before the last block returns true.
__device__ bool last_block(uint32_t* c) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(c, 1u) == gridDim.x - 1;
    if (last) {
      *c = 0;
      __threadfence_system();
    }
  }
  __syncthreads();
  return last;
}

__device__ __forceinline__ void copy_row(const bf16* src, std::byte* dst, int hidden) {
  const auto* s = reinterpret_cast<const uint4*>(src);
  auto* d = reinterpret_cast<uint4*>(dst);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) d[i] = s[i];
}

// The same from a region other ranks write: loads bypass L1 (ld.global.cg), so no line an earlier call left there is
// ever read in place of what the flag announced.
__device__ __forceinline__ void copy_row_from_peers(const std::byte* src, std::byte* dst, int hidden) {
  const auto* s = reinterpret_cast<const uint4*>(src);
  auto* d = reinterpret_cast<uint4*>(dst);
  for (int i = threadIdx.x; i < hidden / 8; i += blockDim.x) d[i] = __ldcg(s + i);
}

// FP8 dispatch payload of one row: per group of 128 values (ops/moe/fp8_block_device.cuh) scale = max|x| / 448 (1 for
// an all-zero group) and codes e4m3(x / scale), round to nearest even, saturating; codes [hidden] then scales
// [hidden / 128] (fp32). One warp per group, four values per lane. ops::ll_fp8_roundtrip_cpu (the test's reference)
// does the same arithmetic.
__device__ void quantize_row_fp8(const bf16* x, std::byte* payload, int hidden) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  auto* scales = reinterpret_cast<float*>(payload + hidden);
  for (int grp = warp; grp < hidden / ops::kLlFp8Group; grp += n_warps) {
    const uint2 raw = *reinterpret_cast<const uint2*>(x + grp * ops::kLlFp8Group + lane * 4);
    const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    const float v[4] = {__low2float(a), __high2float(a), __low2float(b), __high2float(b)};
    const float scale = ops::fp8_block_scale_warp(v);
    *reinterpret_cast<uint32_t*>(payload + grp * ops::kLlFp8Group + lane * 4) = ops::fp8_codes4(v, scale);
    if (lane == 0) scales[grp] = scale;
  }
}

// The inverse into bf16 rows: bf16(float(code) * scale), round to nearest even.
__device__ void dequantize_row_fp8(const std::byte* payload, bf16* row, int hidden) {
  const auto* scales = reinterpret_cast<const float*>(payload + hidden);
  for (int i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
    const uint32_t codes = __ldcg(reinterpret_cast<const unsigned int*>(payload) + i);
    const float scale = __ldcg(scales + (i * 4) / ops::kLlFp8Group);
    __nv_bfloat16 out[4];
    for (int j = 0; j < 4; ++j) {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>((codes >> (8 * j)) & 0xFFu),
                                                   __NV_E4M3);
      out[j] = __float2bfloat16(__half2float(__half(h)) * scale);
    }
    *reinterpret_cast<uint2*>(row + i * 4) = *reinterpret_cast<const uint2*>(out);
  }
}

// One warp: each pair's (rank, slot) bucket and its index there, in pair order (stable, deterministic).
__global__ void __launch_bounds__(32) ll_plan_kernel(LlGeo g, LlDev d, const int32_t* ids, int n_pairs) {
  extern __shared__ int32_t cnt[];
  const int lane = threadIdx.x, nb = g.n_ranks * g.n_local;
  for (int i = lane; i < nb; i += 32) cnt[i] = 0;
  __syncwarp();
  for (int base = 0; base < n_pairs; base += 32) {
    const int p = base + lane;
    int bucket = -1 - lane;  // distinct per lane: an unsent pair matches nobody
    bool send = false;
    if (p < n_pairs) {
      const int32_t e = ids[p];
      if (e >= g.n_experts) {
        atomicOr(d.error_flags, ops::kMoeErrorBadExpertId);
      } else if (e >= 0) {
        bucket = d.owner[e] * g.n_local + d.slot[e];
        send = true;
      }
    }
    const unsigned same = __match_any_sync(0xffffffffu, bucket);
    const int before = __popc(same & ((1u << lane) - 1u));
    const int index = send ? cnt[bucket] + before : 0;
    __syncwarp();
    if (send && before == 0) cnt[bucket] += __popc(same);
    __syncwarp();
    if (p < n_pairs) {
      int32_t m = -1;
      if (send && index < g.max_tokens) {
        m = bucket * g.max_tokens + index;
      } else if (send) {
        atomicOr(d.error_flags, ops::kMoeErrorDuplicateExpert);  // more rows for one slot than tokens
      }
      d.pair_msg[p] = m;
    }
  }
  __syncwarp();
  for (int i = lane; i < nb; i += 32) d.bucket_count[i] = min(cnt[i], g.max_tokens);
}

// Block p: pair p's header and row into its slot on the owner; the last block publishes this rank's dispatch flags.
__global__ void __launch_bounds__(kThreads) ll_send_kernel(LlGeo g, LlDev d, const int32_t* ids, const bf16* x,
                                                           int n_pairs) {
  const uint32_t epoch = *d.epoch;
  const int parity = static_cast<int>(epoch & 1u);
  const int p = blockIdx.x;
  const int32_t m = p < n_pairs ? d.pair_msg[p] : -1;
  if (m >= 0) {
    const int bucket = m / g.max_tokens, index = m % g.max_tokens;
    const int dst = bucket / g.n_local, slot = bucket % g.n_local;
    std::byte* msg = d.peers[dst] + g.dispatch_slots[parity] +
                     (static_cast<size_t>(slot * g.n_ranks + g.rank) * g.max_tokens + index) * g.msg_bytes;
    const int t = p / g.top_k;
    if (threadIdx.x == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, p % g.top_k, ids[p], 0);
    if (g.fp8) {
      quantize_row_fp8(x + static_cast<size_t>(t) * g.hidden, msg + ops::kLlMsgHeaderBytes, g.hidden);
    } else {
      copy_row(x + static_cast<size_t>(t) * g.hidden, msg + ops::kLlMsgHeaderBytes, g.hidden);
    }
  }
  if (!last_block(d.done + 0)) return;
  for (int b = threadIdx.x; b < g.n_ranks * g.n_local; b += blockDim.x) {
    const int dst = b / g.n_local, slot = b % g.n_local;
    auto* f = reinterpret_cast<unsigned long long*>(d.peers[dst] + g.dispatch_flags[parity] +
                                                    static_cast<size_t>(slot * g.n_ranks + g.rank) * kLlFlagBytes);
    store_release_sys(f, flag_value(epoch, d.bucket_count[b]));
  }
}

// One block: waits for every (slot, source) flag of this rank, then writes the routing arrays (rows by slot, in
// source-rank order) and the first packed row of each (slot, source).
__global__ void __launch_bounds__(1024) ll_wait_kernel(LlGeo g, LlDev d, ops::MoeRoutingArrays r, int capacity) {
  extern __shared__ int32_t got[];  // [n_local_here * n_ranks]
  const uint32_t epoch = *d.epoch;
  const int parity = static_cast<int>(epoch & 1u);
  std::byte* mine = d.peers[g.rank];
  const int nb = g.n_local_here * g.n_ranks;
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    const auto* f = reinterpret_cast<const unsigned long long*>(mine + g.dispatch_flags[parity] +
                                                                static_cast<size_t>(b) * kLlFlagBytes);
    const int n = static_cast<int>(static_cast<uint32_t>(wait_flag(f, epoch, g, d, b % g.n_ranks, "dispatch"))) - 1;
    if (n < 0 || n > g.max_tokens) {
      atomicOr(d.error_flags, ops::kMoeErrorExchange);
      got[b] = 0;
    } else {
      got[b] = n;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int row = 0, tiles = 0, n_active = 0;
  for (int s = 0; s < g.n_local_here; ++s) {
    r.offsets[s] = row;
    r.tile_offsets[s] = tiles;
    const int first = row;
    for (int src = 0; src < g.n_ranks; ++src) {
      d.recv_base[s * g.n_ranks + src] = row;
      int n = got[s * g.n_ranks + src];
      if (row + n > capacity) {  // more rows than the step agreement allows for: never written past the buffers
        atomicOr(d.error_flags, ops::kMoeErrorExchange);
        n = capacity - row;
      }
      row += n;
    }
    r.counts[s] = row - first;
    if (row > first) r.active[n_active++] = s;
    tiles += (row - first + ops::kMoeTileRows - 1) / ops::kMoeTileRows;
  }
  r.offsets[g.n_local_here] = row;
  r.tile_offsets[g.n_local_here] = tiles;
  d.recv_base[nb] = row;
  *r.n_active = n_active;
}

// Received rows -> rows [packed, hidden] and origin (source rank's pair index, in the layout's numbering).
__global__ void __launch_bounds__(kThreads) ll_unpack_kernel(LlGeo g, LlDev d, bf16* rows, int32_t* origin,
                                                             int capacity) {
  const int parity = static_cast<int>(*d.epoch & 1u);
  const int nb = g.n_local_here * g.n_ranks;
  const int total = min(d.recv_base[nb], capacity);
  const std::byte* mine = d.peers[g.rank];
  for (int r = blockIdx.x; r < total; r += gridDim.x) {
    int lo = 0, hi = nb - 1;  // the last bucket whose first row is <= r
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (d.recv_base[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const int slot = lo / g.n_ranks, src = lo % g.n_ranks, index = r - d.recv_base[lo];
    const std::byte* msg = mine + g.dispatch_slots[parity] +
                           (static_cast<size_t>(slot * g.n_ranks + src) * g.max_tokens + index) * g.msg_bytes;
    const int4 h = __ldcg(reinterpret_cast<const int4*>(msg));
    const bool ok = h.x >= 0 && h.x < g.max_tokens && h.y >= 0 && h.y < g.top_k;
    if (threadIdx.x == 0) {
      if (!ok) atomicOr(d.error_flags, ops::kMoeErrorExchange);
      origin[r] = ok ? (src * g.max_tokens + h.x) * g.top_k + h.y : -1;
    }
    if (g.fp8) {
      dequantize_row_fp8(msg + ops::kLlMsgHeaderBytes, rows + static_cast<size_t>(r) * g.hidden, g.hidden);
    } else {
      copy_row_from_peers(msg + ops::kLlMsgHeaderBytes,
                          reinterpret_cast<std::byte*>(rows + static_cast<size_t>(r) * g.hidden), g.hidden);
    }
  }
}

// Each expert output row back to its sender's combine row; the last block publishes this rank's combine flag.
__global__ void __launch_bounds__(kThreads) ll_return_kernel(LlGeo g, LlDev d, const bf16* y, const int32_t* origin,
                                                             int capacity) {
  const uint32_t epoch = *d.epoch;
  const int parity = static_cast<int>(epoch & 1u);
  const int total = min(d.recv_base[g.n_local_here * g.n_ranks], capacity);
  const int per_rank = g.max_tokens * g.top_k;
  for (int r = blockIdx.x; r < total; r += gridDim.x) {
    const int o = origin[r];
    if (o < 0) continue;
    const int src = o / per_rank, pair = o % per_rank;
    copy_row(y + static_cast<size_t>(r) * g.hidden,
             d.peers[src] + g.combine_rows[parity] + static_cast<size_t>(pair) * g.combine_row_bytes, g.hidden);
  }
  if (!last_block(d.done + 1)) return;
  for (int dst = threadIdx.x; dst < g.n_ranks; dst += blockDim.x) {
    auto* f = reinterpret_cast<unsigned long long*>(d.peers[dst] + g.combine_flags[parity] +
                                                    static_cast<size_t>(g.rank) * kLlFlagBytes);
    store_release_sys(f, flag_value(epoch, 0));
  }
}

// Block t: waits for every rank's combine flag, then out[t] = bf16(out[t] + sum_k w[t,k] y(t,k)) with fmaf in k order
// over the pairs that were sent (moe_combine's arithmetic). The last block advances the epoch.
__global__ void __launch_bounds__(kThreads) ll_reduce_kernel(LlGeo g, LlDev d, const float* w, bf16* out,
                                                             int n_tokens) {
  const uint32_t epoch = *d.epoch;
  const int parity = static_cast<int>(epoch & 1u);
  const std::byte* mine = d.peers[g.rank];
  for (int src = threadIdx.x; src < g.n_ranks; src += blockDim.x) {
    wait_flag(reinterpret_cast<const unsigned long long*>(mine + g.combine_flags[parity] +
                                                          static_cast<size_t>(src) * kLlFlagBytes),
              epoch, g, d, src, "combine");
  }
  __syncthreads();
  const int t = blockIdx.x;
  if (t < n_tokens) {
    // Eight values per thread (16-byte loads and stores); each value's arithmetic is the scalar one.
    const std::byte* rows = mine + g.combine_rows[parity];
    auto* o = reinterpret_cast<uint4*>(out + static_cast<size_t>(t) * g.hidden);
    for (int j = threadIdx.x; j < g.hidden / 8; j += blockDim.x) {
      uint4 packed = o[j];
      float acc[8];
      const auto* ov = reinterpret_cast<const bf16*>(&packed);
      for (int i = 0; i < 8; ++i) acc[i] = __bfloat162float(ov[i]);
      for (int k = 0; k < g.top_k; ++k) {
        const int p = t * g.top_k + k;
        if (d.pair_msg[p] < 0) continue;
        const float wk = w[p];
        const uint4 y = __ldcg(reinterpret_cast<const uint4*>(rows + static_cast<size_t>(p) * g.combine_row_bytes) + j);
        const auto* yv = reinterpret_cast<const bf16*>(&y);
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(wk, __bfloat162float(yv[i]), acc[i]);
      }
      auto* pv = reinterpret_cast<bf16*>(&packed);
      for (int i = 0; i < 8; ++i) pv[i] = __float2bfloat16(acc[i]);
      o[j] = packed;
    }
  }
  if (last_block(d.done + 2) && threadIdx.x == 0) *d.epoch = epoch + 1;
}

class LlExchange final : public Exchange {
 public:
  LlExchange(Backend& be, const LlExchangeConfig& c, LlPeerRegions peers)
      : c_(c), peers_(std::move(peers)), shape_(ll_exchange_shape(c)), layout_(ops::ll_layout(shape_, kLlFlagBytes)) {
    BG_CHECK(be.device() == DeviceKind::kCuda && be.act_dtype() == DType::kBF16, "ll exchange: needs the CUDA "
             "backend (got {})", be.name());
    const ExpertPlacement& p = c_.placement;
    BG_CHECK(static_cast<int64_t>(peers_.regions.size()) == shape_.n_ranks, "ll exchange: {} peer regions for {} "
             "ranks", peers_.regions.size(), shape_.n_ranks);
    BG_CHECK(c_.hidden % 8 == 0, "ll exchange: hidden {} must be a multiple of 8 (16-byte row copies)", c_.hidden);
    BG_CHECK(shape_.n_ranks * shape_.n_local * shape_.max_tokens < (int64_t{1} << 31),
             "ll exchange: {} ranks x {} slots x {} tokens overflow 32-bit message indices", shape_.n_ranks,
             shape_.n_local, shape_.max_tokens);
    const CudaStreamContext sc = cuda_stream_context(be);
    stream_ = static_cast<cudaStream_t>(sc.stream);
    int device = 0;
    cuda_check(cudaGetDevice(&device), "device");
    cuda_check(cudaDeviceGetAttribute(&n_sms_, cudaDevAttrMultiProcessorCount, device), "SM count");

    g_.n_ranks = static_cast<int>(shape_.n_ranks);
    g_.n_local = static_cast<int>(shape_.n_local);
    g_.max_tokens = static_cast<int>(shape_.max_tokens);
    g_.top_k = static_cast<int>(shape_.top_k);
    g_.hidden = static_cast<int>(shape_.hidden);
    g_.fp8 = shape_.fp8;
    g_.rank = static_cast<int>(p.rank());
    g_.n_experts = static_cast<int>(p.n_experts());
    g_.n_local_here = static_cast<int>(p.n_local());
    g_.msg_bytes = layout_.msg_bytes;
    g_.combine_row_bytes = layout_.combine_row_bytes;
    for (int q = 0; q < 2; ++q) {
      g_.dispatch_slots[q] = layout_.dispatch_slots[q];
      g_.dispatch_flags[q] = layout_.dispatch_flags[q];
      g_.combine_rows[q] = layout_.combine_rows[q];
      g_.combine_flags[q] = layout_.combine_flags[q];
    }
    g_.timeout_ns = static_cast<unsigned long long>(std::max(1.0, c_.timeout_s) * 1e9);

    // One allocation for the device-side tables and scratch (int32 words, each array 64-byte aligned).
    const int64_t n_pairs = shape_.max_tokens * shape_.top_k, nb = shape_.n_ranks * shape_.n_local;
    std::vector<int64_t> words = {shape_.n_ranks * 2, p.n_experts(), p.n_experts(), 1, 3, n_pairs, nb,
                                  p.n_local() * shape_.n_ranks + 1};
    std::vector<int64_t> at;
    int64_t total = 0;
    for (int64_t n : words) {
      at.push_back(total);
      total += (n + 15) / 16 * 16;
    }
    void* mem = nullptr;
    cuda_check(cudaMalloc(&mem, static_cast<size_t>(total) * 4), "tables");
    mem_.reset(mem, [](void* q) { cudaFree(q); });
    auto* base = static_cast<int32_t*>(mem);
    d_.peers = reinterpret_cast<std::byte* const*>(base + at[0]);
    d_.owner = base + at[1];
    d_.slot = base + at[2];
    d_.epoch = reinterpret_cast<uint32_t*>(base + at[3]);
    d_.done = reinterpret_cast<uint32_t*>(base + at[4]);
    d_.pair_msg = base + at[5];
    d_.bucket_count = base + at[6];
    d_.recv_base = base + at[7];
    d_.error_flags = sc.error_flags;
    std::vector<int32_t> owner, slot;
    for (int64_t e = 0; e < p.n_experts(); ++e) {
      owner.push_back(p.owner(e));
      slot.push_back(p.slot(e));
    }
    const uint32_t first_epoch = 1, zeros[3] = {0, 0, 0};
    cuda_check(cudaMemcpy(base + at[0], peers_.regions.data(), peers_.regions.size() * sizeof(void*),
                          cudaMemcpyHostToDevice), "peers");
    cuda_check(cudaMemcpy(base + at[1], owner.data(), owner.size() * 4, cudaMemcpyHostToDevice), "owners");
    cuda_check(cudaMemcpy(base + at[2], slot.data(), slot.size() * 4, cudaMemcpyHostToDevice), "slots");
    cuda_check(cudaMemcpy(d_.epoch, &first_epoch, 4, cudaMemcpyHostToDevice), "epoch");
    cuda_check(cudaMemcpy(d_.done, zeros, sizeof(zeros), cudaMemcpyHostToDevice), "counters");
    // The watchdog's word: pinned host memory the kernels read through its device mapping.
    void* abort_host = nullptr;
    cuda_check(cudaHostAlloc(&abort_host, sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable), "abort word");
    abort_.reset(static_cast<uint32_t*>(abort_host), [](uint32_t* q) { cudaFreeHost(q); });
    *abort_ = 0;
    void* abort_dev = nullptr;
    cuda_check(cudaHostGetDevicePointer(&abort_dev, abort_host, 0), "abort word mapping");
    d_.abort = static_cast<const volatile uint32_t*>(abort_dev);
    if (c_.check_peers) watchdog_ = std::thread([this] { watch(); });
    log::info("ll exchange: rank {} of {}, {} expert slots here ({} per rank at most), {} tokens per call, top-{}, "
              "hidden {}, {} dispatch, {:.1f} MiB region", p.rank(), shape_.n_ranks, p.n_local(), shape_.n_local,
              shape_.max_tokens, shape_.top_k, shape_.hidden, shape_.fp8 ? "fp8" : "bf16",
              static_cast<double>(layout_.region_bytes) / (1 << 20));
  }

  ~LlExchange() override { quiesce(); }

  // The set agreed to stop: the peers exit now, which is no failure to report; no wait of this exchange follows.
  void quiesce() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
  }

  std::string_view name() const override { return "ll"; }
  int64_t n_ranks() const override { return shape_.n_ranks; }
  int64_t rank() const override { return c_.placement.rank(); }
  int64_t max_tokens_per_call() const override { return shape_.max_tokens; }
  bool capturable() const override { return c_.capturable; }

  void begin_dispatch(Backend& be, const ExpertTable& table, const DispatchInput& in, ExpertRows& rows) override {
    BG_CHECK(in.ids && in.weights && in.x, "ll exchange: incomplete dispatch input");
    BG_CHECK(table.n_slots() == g_.n_local_here && table.n_experts() == g_.n_experts, "ll exchange: table of {} "
             "slots / {} experts, placement of {} / {}", table.n_slots(), table.n_experts(), g_.n_local_here,
             g_.n_experts);
    n_tokens_ = in.x->rows();
    BG_CHECK(n_tokens_ <= shape_.max_tokens, "ll exchange: {} tokens in one call, at most {}", n_tokens_,
             shape_.max_tokens);
    BG_CHECK(n_tokens_ == 0 || (in.x->cols() == shape_.hidden && in.ids->cols() == shape_.top_k &&
                                in.x->dtype == DType::kBF16 && in.ids->dtype == DType::kI32 &&
                                in.weights->dtype == DType::kF32),
             "ll exchange: rows of {} ({}) and top-{} for an exchange of {} (bf16) and top-{}", in.x->cols(),
             dtype_name(in.x->dtype), in.ids->cols(), shape_.hidden, shape_.top_k);
    ids_ = *in.ids;
    weights_ = *in.weights;
    const int n_pairs = static_cast<int>(n_tokens_ * shape_.top_k);
    const int32_t* ids = n_pairs > 0 ? ids_.as<int32_t>() : nullptr;
    const size_t plan_smem = static_cast<size_t>(g_.n_ranks * g_.n_local) * 4;
    ll_plan_kernel<<<1, 32, plan_smem, stream_>>>(g_, d_, ids, n_pairs);
    cuda_check(cudaGetLastError(), "plan launch");
    ll_send_kernel<<<static_cast<unsigned>(std::max(n_pairs, 1)), kThreads, 0, stream_>>>(
        g_, d_, ids, n_pairs > 0 ? in.x->as<bf16>() : nullptr, n_pairs);
    cuda_check(cudaGetLastError(), "send launch");
    // Receive side, sized by this step's tokens per rank (the step agreement) so the expert kernels see a realistic
    // row count: every source sends each token to at most min(top_k, slots) of this rank's slots.
    const int64_t tokens = step_tokens() > 0 ? std::min(step_tokens(), shape_.max_tokens) : shape_.max_tokens;
    const ops::MoeRoutingShape recv{shape_.n_ranks * tokens, std::min(shape_.top_k, shape_.n_local),
                                    table.n_experts(), table.n_slots(), false};
    capacity_ = recv.n_pairs();
    rows.routing = be.moe_routing(recv);
    rows.x = be.act(capacity_, shape_.hidden);
    rows.y = be.act(capacity_, shape_.hidden);
    rows.origin = be.alloc({capacity_}, DType::kI32);
  }

  void finish_dispatch(Backend&, ExpertRows& rows) override {
    const ops::MoeRoutingArrays r = ops::moe_routing_layout(rows.routing.shape, rows.routing.buffer.data);
    const size_t smem = static_cast<size_t>(g_.n_local_here * g_.n_ranks) * 4;
    ll_wait_kernel<<<1, 1024, smem, stream_>>>(g_, d_, r, static_cast<int>(capacity_));
    cuda_check(cudaGetLastError(), "wait launch");
    ll_unpack_kernel<<<grid_rows(), kThreads, 0, stream_>>>(g_, d_, rows.x.as<bf16>(), rows.origin.as<int32_t>(),
                                                            static_cast<int>(capacity_));
    cuda_check(cudaGetLastError(), "unpack launch");
  }

  void begin_combine(Backend&, const ExpertRows& rows, Tensor&) override {
    ll_return_kernel<<<grid_rows(), kThreads, 0, stream_>>>(g_, d_, rows.y.as<bf16>(), rows.origin.as<int32_t>(),
                                                            static_cast<int>(capacity_));
    cuda_check(cudaGetLastError(), "return launch");
  }

  void finish_combine(Backend&, Tensor& out) override {
    BG_CHECK(n_tokens_ == 0 || (out.rows() == n_tokens_ && out.cols() == shape_.hidden &&
                                out.dtype == DType::kBF16),
             "ll exchange: combine into [{}, {}] for {} tokens of {}", out.rows(), out.cols(), n_tokens_,
             shape_.hidden);
    const int n = static_cast<int>(n_tokens_);
    ll_reduce_kernel<<<static_cast<unsigned>(std::max(n, 1)), kThreads, 0, stream_>>>(
        g_, d_, n > 0 ? weights_.as<float>() : nullptr, n > 0 ? out.as<bf16>() : nullptr, n);
    cuda_check(cudaGetLastError(), "reduce launch");
  }

 private:
  // Every 50 ms: is every peer still there? The first failure raises the abort word for good.
  void watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(50), [this] { return stop_; })) {
      try {
        c_.check_peers();
      } catch (const std::exception& e) {
        log::error("ll exchange: rank {}: {}; stopping this rank's exchange waits", c_.placement.rank(), e.what());
        *reinterpret_cast<volatile uint32_t*>(abort_.get()) = 1;
        return;
      }
    }
  }

  unsigned grid_rows() const {
    return static_cast<unsigned>(std::clamp<int64_t>(capacity_, 1, static_cast<int64_t>(n_sms_) * 4));
  }

  LlExchangeConfig c_;
  LlPeerRegions peers_;
  ops::LlShape shape_;
  ops::LlLayout layout_;
  LlGeo g_;
  LlDev d_;
  std::shared_ptr<void> mem_;
  cudaStream_t stream_ = nullptr;
  int n_sms_ = 1;
  int64_t n_tokens_ = 0, capacity_ = 0;
  Tensor ids_, weights_;
  std::shared_ptr<uint32_t> abort_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread watchdog_;  // last: joined before anything it reads goes
};

}  // namespace

std::unique_ptr<Exchange> make_ll_exchange(Backend& be, const LlExchangeConfig& config, LlPeerRegions peers) {
  return std::make_unique<LlExchange>(be, config, std::move(peers));
}

}  // namespace bg::moe

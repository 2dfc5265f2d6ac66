// CUDA sampling of one step's rows in five kernels over a workspace, so that a row spreads over many CTAs and the
// logits are read three times (statistics, histograms, candidates) by the whole GPU:
//   1. row_stats: per chunk of a row, the largest key, the smallest finite logit and a non-finite flag; clears the
//      row's histograms.
//   2. row_histogram: per chunk, every logit's value bin (monotone in the logit: a bin is a contiguous run of the
//      CPU's sorted order) summed into the row's histograms of fixed-point mass and of counts, and the log Z partials.
//   3. row_plan: one CTA per row bounds, from the histograms alone, the bins each cut can fall in (top-k, top-p, the
//      pick, the n_top best): the earlier cuts are not exact yet, but each target is monotone in the kept mass.
//   4. row_gather: per chunk, every logit whose bin lies in such a window is appended to that window's list.
//   5. row_pick: one CTA per row walks the histograms to the bin holding each cut, takes that bin's candidates from a
//      window's list (or, when no window holds them, from a pass over the row), sorts them in shared memory and scans
//      their weights. A bin too large for shared memory falls back to a radix descent over the row.
// Keys: the order-preserving logit bits, then the inverted index, so that descending key order is exactly the CPU's
// (logit descending, lower index first; -0 and +0 tie). Probabilities are 2^-44 fixed point: integer sums are exact and
// order-free, so the histograms, the cuts and the ids do not depend on how the row was split.
#include "ops/sampling/sampling_cuda.h"

#include <algorithm>
#include <cstddef>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using u64 = unsigned long long;

constexpr int kBins = 2048;                      // value bins per row; the last also takes all past the span
constexpr int kBlock = 1024;                     // logits per block: chunks are whole blocks; log Z per block
constexpr int kChunkThreads = 256;               // row_stats and row_histogram
constexpr int kPickThreads = 512;                // row_pick
constexpr int kGather = 2048;                    // the most candidates of one bin resolved in shared memory
constexpr int kTargetCtas = 1024;                // chunks per row: about eight CTAs per SM over the batch
constexpr double kMassScale = 17592186044416.0;  // 2^44: a probability p in [0, 1] weighs rint(p * 2^44)
constexpr double kZeroWeightNats = 31.5;         // exp(-31.5) * 2^44 = 0.37: rounds to 0, as does all below it
constexpr float kSpanNats = 32.0f;               // bins cover at most 32 nats (at the temperature) below the max
// Fixed-point mass: at most kSamplingMaxVocab (2^19) * 2^44 = 2^63 in total, so u64 sums never overflow.

// Per chunk of a row (row_stats) and per block of a row (log Z partials, row_histogram).
struct ChunkStat {
  u64 best;          // largest key among the finite logits (0: none)
  unsigned min_ord;  // smallest ordered finite logit (0xffffffff: none)
  int non_finite;    // 1: NaN or +-Inf in the chunk
};

int64_t blocks_of(int64_t vocab) { return (vocab + kBlock - 1) / kBlock; }

// Blocks per chunk: the chunks of every row together make about kTargetCtas CTAs.
int blocks_per_chunk(int64_t n_rows, int64_t vocab) {
  const int64_t chunks = std::max<int64_t>(1, std::min(blocks_of(vocab), (kTargetCtas + n_rows - 1) / n_rows));
  return static_cast<int>((blocks_of(vocab) + chunks - 1) / chunks);
}

// The bin windows whose candidates row_gather collects for row_pick (so that row_pick need not pass over the row):
// the bin of the top-k cut, the bins the top-p cut and the pick can fall in (bounded from the histograms before the
// earlier cuts are exact), and the bins of the n_top best.
enum Window { kWinTopK, kWinTopP, kWinPick, kWinBest, kWindows };

struct RowPlan {
  int lo[kWindows], hi[kWindows];  // bin ranges; lo > hi: none
  unsigned n[kWindows];            // candidates appended (> kGather: too many; only the count is right)
  int any;                         // some window is set
};

// The workspace of n_rows entries: [ChunkStat x blocks][double x blocks][u64 mass x kBins][u32 count x kBins]
// [RowPlan][u64 keys x kGather x kWindows] per row, each array over all rows.
struct Workspace {
  ChunkStat* stats;
  double* z;
  u64* mass;
  unsigned* count;
  RowPlan* plans;
  u64* lists;  // [n_rows][kWindows][kGather]
  int blocks;  // per row
};

Workspace carve(void* base, int64_t n_rows, int64_t vocab) {
  const int64_t blocks = blocks_of(vocab);
  auto* p = static_cast<std::byte*>(base);
  Workspace w{};
  w.blocks = static_cast<int>(blocks);
  w.stats = reinterpret_cast<ChunkStat*>(p);
  p += n_rows * blocks * static_cast<int64_t>(sizeof(ChunkStat));
  w.z = reinterpret_cast<double*>(p);
  p += n_rows * blocks * static_cast<int64_t>(sizeof(double));
  w.mass = reinterpret_cast<u64*>(p);
  p += n_rows * kBins * static_cast<int64_t>(sizeof(u64));
  w.lists = reinterpret_cast<u64*>(p);
  p += n_rows * kWindows * kGather * static_cast<int64_t>(sizeof(u64));
  w.plans = reinterpret_cast<RowPlan*>(p);
  p += n_rows * static_cast<int64_t>(sizeof(RowPlan));
  w.count = reinterpret_cast<unsigned*>(p);
  return w;
}

size_t workspace_bytes(int64_t n_rows, int64_t vocab) {
  const int64_t per_row = blocks_of(vocab) * static_cast<int64_t>(sizeof(ChunkStat) + sizeof(double)) +
                          kBins * static_cast<int64_t>(sizeof(u64) + sizeof(unsigned)) +
                          kWindows * kGather * static_cast<int64_t>(sizeof(u64)) +
                          static_cast<int64_t>(sizeof(RowPlan));
  return static_cast<size_t>(n_rows * per_row);
}

// Order-preserving bits: a > b as floats <=> ordered(a) > ordered(b); -0 maps like +0 (they tie on the CPU).
__device__ __forceinline__ unsigned ordered(float f) {
  const unsigned b = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_ordered(unsigned o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// Larger key = earlier in the CPU's sorted order. Every key of a finite logit is > 0.
__device__ __forceinline__ u64 make_key(unsigned ord, int i) {
  return (static_cast<u64>(ord) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}
__device__ __forceinline__ int key_index(u64 key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
}
__device__ __forceinline__ float key_logit(u64 key) { return from_ordered(static_cast<unsigned>(key >> 32)); }

// The fixed-point weight exp((l - max) / T) * 2^44 in double, as the CPU computes it but with the division by T done as
// a product with 1 / T (exact at T = 1; elsewhere within an ulp of x, far below the 2^-44 rounding of the weight). 0
// past kZeroWeightNats, where it rounds to 0 anyway.
__device__ __forceinline__ u64 mass_of(float l, double max_logit, double inv_temperature) {
  const double x = (static_cast<double>(l) - max_logit) * inv_temperature;
  return x < -kZeroWeightNats ? 0 : __double2ull_rn(exp(x) * kMassScale);
}

// Four consecutive logits from i (a multiple of 4): one 16-byte load when the row allows it, else scalar loads; entries
// at or past end are 0 (callers skip them).
__device__ __forceinline__ float4 load4(const float* row, int i, int end, bool vec) {
  if (vec && i + 4 <= end) return __ldg(reinterpret_cast<const float4*>(row + i));
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (i < end) v.x = row[i];
  if (i + 1 < end) v.y = row[i + 1];
  if (i + 2 < end) v.z = row[i + 2];
  if (i + 3 < end) v.w = row[i + 3];
  return v;
}
__device__ __forceinline__ float lane_of(const float4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}
// True when a row's 16-byte loads are aligned.
__device__ __forceinline__ bool vector_row(const float* row) { return (reinterpret_cast<uintptr_t>(row) & 15u) == 0; }

// The value bins of one row: bin 0 holds the maximum; d = max - l, rounded once, scaled and truncated, so the bin is
// monotone (non-increasing) in the logit and computed bit for bit alike by every kernel (explicit rounding, no FMA).
struct Binning {
  float max_logit;
  float scale;
  float tail;  // d >= tail: the last bin
};

__device__ __forceinline__ Binning make_binning(float max_logit, float min_logit, float temperature) {
  const float t = temperature > 0.0f ? temperature : 1.0f;
  const float span = fminf(__fsub_rn(max_logit, min_logit), __fmul_rn(kSpanNats, t));
  if (!(span > 0.0f)) return {max_logit, 0.0f, INFINITY};  // every logit equal: one bin
  return {max_logit, __fdiv_rn(static_cast<float>(kBins - 1), span), span};
}

__device__ __forceinline__ int bin_of(const Binning& bn, float l) {
  const float d = __fsub_rn(bn.max_logit, l);
  if (!(d < bn.tail)) return kBins - 1;
  return min(static_cast<int>(__fmul_rn(d, bn.scale)), kBins - 2);
}

// A row's statistics, reduced over its chunk stats by a whole block (every thread gets them).
struct RowInfo {
  u64 best;
  float max_logit, min_logit;
  bool non_finite;
};

struct ReduceScratch {
  u64 u64s[32];
  unsigned u32s[32];
  int ints[32];
};

__device__ RowInfo row_info(const ChunkStat* stats, int n_chunks, ReduceScratch& rs) {
  u64 best = 0;
  unsigned min_ord = 0xffffffffu;
  int non_finite = 0;
  for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) {
    best = max(best, stats[c].best);
    min_ord = min(min_ord, stats[c].min_ord);
    non_finite |= stats[c].non_finite;
  }
  best = cuda_util::block_reduce(best, cuda_util::MaxOp{}, u64{0}, rs.u64s);
  min_ord = cuda_util::block_reduce(min_ord, cuda_util::MinOp{}, 0xffffffffu, rs.u32s);
  non_finite = cuda_util::block_reduce(non_finite, cuda_util::MaxOp{}, 0, rs.ints);
  RowInfo info{};
  info.best = best;
  info.non_finite = non_finite != 0 || best == 0;
  info.max_logit = key_logit(best);
  info.min_logit = from_ordered(min_ord);
  return info;
}

// What row_histogram must sum for a row.
struct RowNeeds {
  bool sample, counts, log_z;
};

__device__ __forceinline__ bool params_ok(const RowSampling& rs) {
  const SamplingParams& p = rs.params;
  return p.top_p > 0.0f && p.top_p <= 1.0f && p.top_k >= 0 && rs.uniform >= 0.0 && rs.uniform < 1.0;
}

__device__ __forceinline__ RowNeeds needs_of(const RowSampling& rs, int vocab) {
  const bool sample = rs.params.temperature > 0.0f && params_ok(rs);
  const bool top_k = sample && rs.params.top_k > 0 && rs.params.top_k < vocab;
  return {sample, top_k || rs.n_top > 0, rs.n_top >= 0};
}

// ---- kernel 1: chunk statistics ------------------------------------------------------------------------------------
// grid (chunks per row, n_rows), block kChunkThreads.
__global__ void __launch_bounds__(kChunkThreads)
    row_stats_kernel(int vocab, int chunk_len, const RowSampling* rows, const float* logits, Workspace ws) {
  __shared__ ReduceScratch rs;
  const int r = blockIdx.y, c = blockIdx.x, n_chunks = gridDim.x;
  const float* row = logits + static_cast<int64_t>(rows[r].row) * vocab;
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const bool vec = vector_row(row);
  u64 best = 0;
  unsigned min_ord = 0xffffffffu;
  int non_finite = 0;
  constexpr int kVecs = 2;  // float4 loads in flight per thread
  for (int base = begin; base < end; base += 4 * kVecs * kChunkThreads) {
    float4 v[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
      v[u] = load4(row, base + (u * kChunkThreads + static_cast<int>(threadIdx.x)) * 4, end, vec);
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = base + (u * kChunkThreads + static_cast<int>(threadIdx.x)) * 4 + k;
        const float l = lane_of(v[u], k);
        if (i >= end) continue;
        if (isfinite(l)) {
          const unsigned o = ordered(l);
          best = max(best, make_key(o, i));
          min_ord = min(min_ord, o);
        } else {
          non_finite = 1;
        }
      }
    }
  }
  best = cuda_util::block_reduce(best, cuda_util::MaxOp{}, u64{0}, rs.u64s);
  min_ord = cuda_util::block_reduce(min_ord, cuda_util::MinOp{}, 0xffffffffu, rs.u32s);
  non_finite = cuda_util::block_reduce(non_finite, cuda_util::MaxOp{}, 0, rs.ints);
  if (threadIdx.x == 0) ws.stats[static_cast<int64_t>(r) * ws.blocks + c] = {best, min_ord, non_finite};
  // This chunk's share of the row's histograms starts at zero (row_histogram adds to them).
  u64* mass = ws.mass + static_cast<int64_t>(r) * kBins;
  unsigned* count = ws.count + static_cast<int64_t>(r) * kBins;
  const int bin_begin = c * kBins / n_chunks, bin_end = (c + 1) * kBins / n_chunks;
  for (int b = bin_begin + static_cast<int>(threadIdx.x); b < bin_end; b += kChunkThreads) {
    mass[b] = 0;
    count[b] = 0;
  }
}

// ---- kernel 2: histograms and log Z partials -----------------------------------------------------------------------
struct HistShared {
  u64 mass[kBins];
  unsigned count[kBins];
  double z[kChunkThreads / 32];
  ReduceScratch rs;
};

// grid (chunks per row, n_rows), block kChunkThreads.
__global__ void __launch_bounds__(kChunkThreads)
    row_histogram_kernel(int vocab, int chunk_len, const RowSampling* rows, const float* logits, Workspace ws) {
  __shared__ HistShared sh;
  const int r = blockIdx.y, c = blockIdx.x;
  const RowSampling rsamp = rows[r];
  const RowNeeds need = needs_of(rsamp, vocab);
  if (!need.sample && !need.counts && !need.log_z) return;  // greedy without logprobs: row_pick needs the max only
  const RowInfo info = row_info(ws.stats + static_cast<int64_t>(r) * ws.blocks, gridDim.x, sh.rs);
  if (info.non_finite) return;
  const float* row = logits + static_cast<int64_t>(rsamp.row) * vocab;
  const Binning bn = make_binning(info.max_logit, info.min_logit, rsamp.params.temperature);
  const double max_logit = info.max_logit, inv_temperature = 1.0 / static_cast<double>(rsamp.params.temperature);
  const bool vec = vector_row(row);
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) {
    sh.mass[b] = 0;
    sh.count[b] = 0;
  }
  __syncthreads();
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  // One kBlock at a time (four logits per thread), so that the log Z partial of each block is the same whatever the
  // chunking; the next block's logits are loaded before this block's are processed.
  static_assert(kBlock == 4 * kChunkThreads);
  const int at = static_cast<int>(threadIdx.x) * 4;
  float4 next = load4(row, begin + at, end, vec);
  for (int blk = begin; blk < end; blk += kBlock) {
    const float4 cur = next;
    if (blk + kBlock < end) next = load4(row, blk + kBlock + at, end, vec);
    double z = 0.0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = blk + at + k;
      if (i >= end) continue;
      const float l = lane_of(cur, k);
      if (need.sample || need.counts) {
        const int b = bin_of(bn, l);
        if (need.counts) atomicAdd(&sh.count[b], 1u);
        if (need.sample) {
          const u64 w = mass_of(l, max_logit, inv_temperature);
          if (w != 0) atomicAdd(&sh.mass[b], w);
        }
      }
      if (need.log_z) z += exp(static_cast<double>(l) - max_logit);
    }
    if (need.log_z) {
      z = cuda_util::block_reduce(z, cuda_util::SumOp{}, 0.0, sh.z);
      if (threadIdx.x == 0) ws.z[static_cast<int64_t>(r) * ws.blocks + blk / kBlock] = z;
    }
  }
  __syncthreads();
  u64* mass = ws.mass + static_cast<int64_t>(r) * kBins;
  unsigned* count = ws.count + static_cast<int64_t>(r) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) {
    if (sh.mass[b] != 0) atomicAdd(&mass[b], sh.mass[b]);
    if (sh.count[b] != 0) atomicAdd(&count[b], sh.count[b]);
  }
}

// ---- the cuts and the pick, one CTA per row: helpers ------------------------------------------------------------
struct PickShared {
  u64 mass_excl[kBins + 1];  // exclusive prefix of the mass histogram; [kBins] = total
  unsigned count_excl[kBins + 1];
  u64 keys[kGather];
  u64 hist[256];  // the fallback's radix histogram
  u64 scan_u64[kPickThreads / 32];
  ReduceScratch rs;
  u64 found_key, found_run, found_mass, above;
  unsigned chosen;
  int n_keys, found;
  int n_top_found;
  u64 top_keys[kMaxTopLogprobs];
  RowPlan plan;
};

// The last bin b <= limit whose exclusive prefix is <= target (its weight is then > 0 unless b == limit).
template <typename T>
__device__ __forceinline__ int bin_for(const T* excl, u64 target, int limit) {
  int lo_b = 0, hi_b = limit;
  while (lo_b < hi_b) {
    const int mid = (lo_b + hi_b + 1) / 2;
    if (static_cast<u64>(excl[mid]) <= target) {
      lo_b = mid;
    } else {
      hi_b = mid - 1;
    }
  }
  return lo_b;
}

// The window whose gathered candidates hold every logit of bin b, or -1.
__device__ __forceinline__ int window_of(const RowPlan& plan, int b) {
  for (int w = 0; w < kWindows; ++w) {
    if (plan.lo[w] <= b && b <= plan.hi[w] && plan.n[w] <= static_cast<unsigned>(kGather)) return w;
  }
  return -1;
}

// Appends key to a shared list with one atomic per warp (all 32 lanes call it).
__device__ __forceinline__ void warp_append(bool take, u64 key, int* counter, u64* list, int capacity) {
  const unsigned m = __ballot_sync(0xffffffffu, take);
  if (m == 0) return;
  const int lane = threadIdx.x & 31, leader = __ffs(m) - 1;
  int at = 0;
  if (lane == leader) at = atomicAdd(counter, __popc(m));
  at = __shfl_sync(0xffffffffu, at, leader) + __popc(m & ((1u << lane) - 1u));
  if (take && at < capacity) list[at] = key;
}

enum class Weigh { kCount, kMass };

struct RowCtx {
  const float* logits;
  int vocab;
  Binning bn;
  double max_logit;
  double inv_temperature;  // of the mass weights: 1 / the sampling temperature
  bool vec;                // 16-byte loads of the row are aligned
  const RowPlan* plan;     // row_gather's windows (shared memory copy)
  const u64* lists;        // and their candidates: [kWindows][kGather] (global)
};

template <Weigh kW>
__device__ __forceinline__ u64 weight_of(const RowCtx& row, float l) {
  if constexpr (kW == Weigh::kMass) {
    return mass_of(l, row.max_logit, row.inv_temperature);
  } else {
    return 1;
  }
}

// Exclusive block scan of one u64 per thread (thread order); *total gets the sum.
__device__ u64 block_exclusive_scan(u64 v, u64* scratch, u64* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  u64 incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const u64 n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  u64 before = 0, all = 0;
  for (int w = 0; w < n_warps; ++w) {
    if (w < warp) before += scratch[w];
    all += scratch[w];
  }
  *total = all;
  return before + incl - v;
}

// Exclusive prefix of a histogram (kBins entries, global) into shared excl[0..kBins].
template <typename T>
__device__ void scan_histogram(const T* hist, T* excl, u64* scratch) {
  constexpr int kPer = kBins / kPickThreads;
  static_assert(kBins % kPickThreads == 0);
  T v[kPer];
  u64 sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    v[k] = hist[threadIdx.x * kPer + k];
    sum += v[k];
  }
  u64 total = 0;
  u64 run = block_exclusive_scan(sum, scratch, &total);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    excl[threadIdx.x * kPer + k] = static_cast<T>(run);
    run += v[k];
  }
  if (threadIdx.x == 0) excl[kBins] = static_cast<T>(total);
  __syncthreads();
}

// A cut: the chosen key, its bin, and through it (inclusive, in descending key order over the candidates) the selection
// weight and the mass.
struct Cut {
  u64 key;  // 0: not found (never happens for a valid target; the row then gives
            // -1)
  int bin;
  u64 run;   // selection weight of the candidates ahead of and at `key`
  u64 mass;  // mass of the same candidates (when asked)
};

// Candidates of bin b: every logit whose bin is b and whose key is >= lo.
struct BinPred {
  int bin;
  u64 lo;
};

__device__ __forceinline__ bool in_bin(const RowCtx& row, const BinPred& p, float l, int i, u64* key) {
  if (bin_of(row.bn, l) != p.bin) return false;
  *key = make_key(ordered(l), i);
  return *key >= p.lo;
}

// Gathers the candidates of p into sh.keys (order arbitrary); returns their number (> kGather: too many, only the count
// is right).
__device__ int gather(const RowCtx& row, const BinPred& p, PickShared& sh) {
  if (threadIdx.x == 0) sh.n_keys = 0;
  __syncthreads();
  if (const int w = window_of(*row.plan, p.bin); w >= 0) {  // row_gather has them: filter its list
    const u64* list = row.lists + w * kGather;
    const int n = static_cast<int>(row.plan->n[w]);
    for (int base = 0; base < n; base += kPickThreads) {
      const int i = base + static_cast<int>(threadIdx.x);
      const u64 key = i < n ? list[i] : 0;
      const bool take = i < n && bin_of(row.bn, key_logit(key)) == p.bin && key >= p.lo;
      warp_append(take, key, &sh.n_keys, sh.keys, kGather);
    }
    __syncthreads();
    return sh.n_keys;
  }
  constexpr int kVecs = 4;  // float4 loads in flight per thread: 16 logits an iteration
  for (int base = 0; base < row.vocab; base += 4 * kVecs * kPickThreads) {
    float4 v[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      v[u] = load4(row.logits, base + (u * kPickThreads + static_cast<int>(threadIdx.x)) * 4, row.vocab, row.vec);
    }
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = base + (u * kPickThreads + static_cast<int>(threadIdx.x)) * 4 + k;
        u64 key = 0;
        const bool take = i < row.vocab && in_bin(row, p, lane_of(v[u], k), i, &key);
        warp_append(take, key, &sh.n_keys, sh.keys, kGather);
      }
    }
  }
  __syncthreads();
  return sh.n_keys;
}

// Sorts sh.keys[0..n) descending (n <= kGather), padding with 0 up to the next power of two; returns that size.
__device__ int sort_keys(int n, PickShared& sh) {
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + static_cast<int>(threadIdx.x); i < size; i += kPickThreads) sh.keys[i] = 0;
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += kPickThreads) {
        const int partner = i ^ j;
        if (partner <= i) continue;
        const u64 a = sh.keys[i], b = sh.keys[partner];
        const bool descending = (i & k) == 0;
        if (descending ? a < b : a > b) {
          sh.keys[i] = b;
          sh.keys[partner] = a;
        }
      }
      __syncthreads();
    }
  }
  return size;
}

// Among the sorted keys sh.keys[0..size) (zeros last), the first at which the running selection weight exceeds target:
// sets sh.found_key / found_run (in-bin, inclusive) and, when kAlsoMass, found_mass (in-bin mass through it).
template <Weigh kW, bool kAlsoMass>
__device__ void scan_sorted(const RowCtx& row, int size, u64 target, PickShared& sh) {
  constexpr int kPer = kGather / kPickThreads;
  const int first = static_cast<int>(threadIdx.x) * kPer;
  u64 w[kPer], m[kPer];
  u64 sum = 0, msum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = first + k;
    const u64 key = i < size ? sh.keys[i] : 0;
    w[k] = key != 0 ? weight_of<kW>(row, key_logit(key)) : 0;
    m[k] = kAlsoMass && key != 0 ? mass_of(key_logit(key), row.max_logit, row.inv_temperature) : 0;
    sum += w[k];
    msum += m[k];
  }
  if (threadIdx.x == 0) sh.found = -1;
  u64 total = 0;
  u64 run = block_exclusive_scan(sum, sh.scan_u64,
                                 &total);  // synchronises: found = -1 is visible
  u64 mrun = 0;
  if constexpr (kAlsoMass) {
    __syncthreads();
    mrun = block_exclusive_scan(msum, sh.scan_u64, &total);
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (w[k] > 0 && run <= target && target < run + w[k]) {
      sh.found = first + k;
      sh.found_key = sh.keys[first + k];
      sh.found_run = run + w[k];
      sh.found_mass = mrun + m[k];
    }
    run += w[k];
    mrun += m[k];
  }
  __syncthreads();
}

// Total selection weight (and, when kAlsoMass, mass) of the candidates of p with key >= at_least.
template <Weigh kW, bool kAlsoMass>
__device__ void pred_sums(const RowCtx& row, const BinPred& p, u64 at_least, PickShared& sh, u64* weight, u64* mass) {
  u64 w = 0, m = 0;
  for (int i = threadIdx.x; i < row.vocab; i += kPickThreads) {
    const float l = row.logits[i];
    u64 key = 0;
    if (!in_bin(row, p, l, i, &key) || key < at_least) continue;
    w += weight_of<kW>(row, l);
    if constexpr (kAlsoMass) m += mass_of(l, row.max_logit, row.inv_temperature);
  }
  *weight = cuda_util::block_reduce(w, cuda_util::SumOp{}, u64{0}, sh.rs.u64s);
  *mass = cuda_util::block_reduce(m, cuda_util::SumOp{}, u64{0}, sh.rs.u64s);
}

// The fallback for a bin with more than kGather candidates: a radix descent over the logit bits (four 8-bit histogram
// passes over the row restricted to the bin), then an index-ordered scan among the equal logits left. Returns the key
// of the first candidate (descending key order) at which the running weight exceeds target.
template <Weigh kW>
__device__ u64 radix_select(const RowCtx& row, const BinPred& p, u64 target, PickShared& sh) {
  unsigned prefix = 0, mask = 0;
  u64 above = 0;  // weight of the candidates ahead of the current prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kPickThreads) sh.hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < row.vocab; i += kPickThreads) {
      const float l = row.logits[i];
      const unsigned o = ordered(l);
      u64 key = 0;
      if ((o & mask) != prefix || !in_bin(row, p, l, i, &key)) continue;
      atomicAdd(&sh.hist[(o >> shift) & 255u], weight_of<kW>(row, l));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 run = above;
      int b = 255;
      for (; b > 0; --b) {
        if (run + sh.hist[b] > target) break;
        run += sh.hist[b];
      }
      sh.chosen = static_cast<unsigned>(b);
      sh.above = run;
    }
    __syncthreads();
    prefix |= sh.chosen << shift;
    mask |= 255u << shift;
    above = sh.above;
  }
  // The candidates left share one logit, hence one weight: the answer is the j-th of them in index order.
  const float l = from_ordered(prefix);
  const u64 w = weight_of<kW>(row, l);
  const u64 j = w > 0 ? (target - above) / w : 0;
  const int chunk = (row.vocab + kPickThreads - 1) / kPickThreads;
  const int begin = static_cast<int>(threadIdx.x) * chunk, end = min(row.vocab, begin + chunk);
  auto is_candidate = [&](int i) {
    u64 key = 0;
    return ordered(row.logits[i]) == prefix && in_bin(row, p, row.logits[i], i, &key);
  };
  int count = 0;
  for (int i = begin; i < end; ++i) count += is_candidate(i);
  if (threadIdx.x == 0) sh.found = -1;
  u64 n_all = 0;
  const u64 first = block_exclusive_scan(static_cast<u64>(count), sh.scan_u64, &n_all);
  if (j >= first && j < first + static_cast<u64>(count)) {
    u64 skip = j - first;
    for (int i = begin; i < end; ++i) {
      if (!is_candidate(i)) continue;
      if (skip-- == 0) {
        sh.found = i;
        break;
      }
    }
  }
  __syncthreads();
  const int found = sh.found;
  __syncthreads();
  return found < 0 ? 0 : make_key(prefix, found);
}

// The cut at `target` (selection weight kW) among the candidates: bins below lo_bin whole, bin lo_bin from key lo on.
// excl is the exclusive prefix of the kW histogram over whole bins; target must be below the candidates' total.
template <Weigh kW, bool kAlsoMass, typename T>
__device__ Cut cut(const RowCtx& row, const T* excl, u64 target, u64 lo, int lo_bin, PickShared& sh) {
  const int b = bin_for(excl, target, lo_bin);
  const BinPred p{b, b == lo_bin ? lo : 0};
  const u64 above = excl[b];
  const u64 in_target = target - above;
  Cut c{0, b, 0, 0};
  const int n = gather(row, p, sh);
  if (n <= kGather) {
    const int size = sort_keys(n, sh);
    scan_sorted<kW, kAlsoMass>(row, size, in_target, sh);
    if (sh.found >= 0) c = {sh.found_key, b, above + sh.found_run, sh.found_mass};
    __syncthreads();
    return c;
  }
  const u64 key = radix_select<kW>(row, p, in_target, sh);
  if (key == 0) return c;
  // In-bin weight and mass through `key`: the candidates with key >= it.
  u64 w = 0, m = 0;
  pred_sums<kW, kAlsoMass>(row, p, key, sh, &w, &m);
  return {key, b, above + w, m};
}

// The n best keys of the row (a count cut over the whole row, then the keys at or above it), best first, into
// sh.top_keys by thread 0. counts: the exclusive count prefix.
__device__ void best_keys(const RowCtx& row, const unsigned* count_excl, int n, PickShared& sh) {
  const Cut c = cut<Weigh::kCount, false>(row, count_excl, static_cast<u64>(n - 1), 0, kBins - 1, sh);
  if (threadIdx.x == 0) sh.n_top_found = 0;
  __syncthreads();
  const RowPlan& plan = *row.plan;
  if (plan.lo[kWinBest] == 0 && c.bin <= plan.hi[kWinBest] && plan.n[kWinBest] <= static_cast<unsigned>(kGather)) {
    // row_gather collected every logit of bins 0 .. c.bin: the n best are among them.
    const u64* list = row.lists + kWinBest * kGather;
    for (int i = threadIdx.x; i < static_cast<int>(plan.n[kWinBest]); i += kPickThreads) {
      const u64 key = list[i];
      if (key < c.key) continue;
      const int slot = atomicAdd(&sh.n_top_found, 1);
      if (slot < kMaxTopLogprobs) sh.top_keys[slot] = key;
    }
  } else {
    for (int i = threadIdx.x; i < row.vocab; i += kPickThreads) {
      const float l = row.logits[i];
      if (bin_of(row.bn, l) > c.bin) continue;
      const u64 key = make_key(ordered(l), i);
      if (key < c.key) continue;
      const int slot = atomicAdd(&sh.n_top_found, 1);
      if (slot < kMaxTopLogprobs) sh.top_keys[slot] = key;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int a = 1; a < n; ++a) {  // insertion sort, largest key (best) first
      const u64 key = sh.top_keys[a];
      int b = a;
      for (; b > 0 && sh.top_keys[b - 1] < key; --b) sh.top_keys[b] = sh.top_keys[b - 1];
      sh.top_keys[b] = key;
    }
  }
  __syncthreads();
}

// Smallest prefix with mass / total >= top_p: the first key at which the running mass exceeds ceil(top_p * kept) - 1.
// Then the pick, as on the CPU: the first id whose running mass exceeds u * kept. Both targets are monotone in the
// kept mass, so bounds on the kept mass give bounds on the targets (row_plan).
__device__ __forceinline__ u64 top_p_target(float top_p, u64 kept) {
  const u64 need = static_cast<u64>(ceil(static_cast<double>(top_p) * static_cast<double>(kept)));
  return min(max(need, u64{1}), kept) - 1;
}
__device__ __forceinline__ u64 pick_target(double u, u64 kept) {
  return min(static_cast<u64>(u * static_cast<double>(kept)), kept - 1);
}

// The sampled id of a sampling row (all threads return it); -1 if a cut was not found.
__device__ int sample_row(const RowSampling& rs, const RowCtx& row, const int64_t r, const Workspace& ws,
                          PickShared& sh) {
  const SamplingParams& sp = rs.params;
  scan_histogram(ws.mass + r * kBins, sh.mass_excl, sh.scan_u64);
  u64 kept = sh.mass_excl[kBins];
  u64 lo = 0;
  int lo_bin = kBins - 1;
  if (sp.top_k > 0 && sp.top_k < row.vocab) {
    scan_histogram(ws.count + r * kBins, sh.count_excl, sh.scan_u64);
    const Cut c = cut<Weigh::kCount, true>(row, sh.count_excl, static_cast<u64>(sp.top_k - 1), 0, kBins - 1, sh);
    if (c.key == 0) return -1;
    lo = c.key;
    lo_bin = c.bin;
    kept = sh.mass_excl[c.bin] + c.mass;
  }
  if (sp.top_p < 1.0f) {
    const Cut c = cut<Weigh::kMass, false>(row, sh.mass_excl, top_p_target(sp.top_p, kept), lo, lo_bin, sh);
    if (c.key == 0) return -1;
    lo = c.key;
    lo_bin = c.bin;
    kept = c.run;
  }
  const Cut c = cut<Weigh::kMass, false>(row, sh.mass_excl, pick_target(rs.uniform, kept), lo, lo_bin, sh);
  return c.key == 0 ? -1 : key_index(c.key);
}

// ---- kernels 3 and 4: the windows, and their candidates -----------------------------------------------------------

struct PlanShared {
  u64 mass_excl[kBins + 1];
  unsigned count_excl[kBins + 1];
  u64 scan_u64[kPickThreads / 32];
  ReduceScratch rs;
};

// grid (n_rows), block kPickThreads: ws.plans[r], the windows of row r (none for rows row_pick resolves without).
__global__ void __launch_bounds__(kPickThreads) row_plan_kernel(int vocab, int n_chunks, const RowSampling* rows,
                                                                Workspace ws) {
  __shared__ PlanShared sh;
  const int64_t r = blockIdx.x;
  const RowSampling rs = rows[r];
  const RowNeeds need = needs_of(rs, vocab);
  int lo[kWindows], hi[kWindows];
  for (int w = 0; w < kWindows; ++w) {
    lo[w] = 1;
    hi[w] = 0;
  }
  const RowInfo info = row_info(ws.stats + r * ws.blocks, n_chunks, sh.rs);
  if (!info.non_finite && need.sample) {
    const SamplingParams& sp = rs.params;
    scan_histogram(ws.mass + r * kBins, sh.mass_excl, sh.scan_u64);
    // Bounds on the kept mass and on the bin limit before each cut.
    u64 kept_lo = sh.mass_excl[kBins], kept_hi = kept_lo;
    int limit_lo = kBins - 1, limit_hi = kBins - 1;
    if (sp.top_k > 0 && sp.top_k < vocab) {
      scan_histogram(ws.count + r * kBins, sh.count_excl, sh.scan_u64);
      const int bk = bin_for(sh.count_excl, static_cast<u64>(sp.top_k - 1), kBins - 1);
      lo[kWinTopK] = hi[kWinTopK] = bk;
      kept_lo = max(sh.mass_excl[bk], u64{1});
      kept_hi = sh.mass_excl[bk + 1];
      limit_lo = limit_hi = bk;
    }
    if (sp.top_p < 1.0f) {
      const u64 t_lo = top_p_target(sp.top_p, kept_lo), t_hi = top_p_target(sp.top_p, kept_hi);
      lo[kWinTopP] = bin_for(sh.mass_excl, t_lo, limit_lo);
      hi[kWinTopP] = bin_for(sh.mass_excl, t_hi, limit_hi);
      // The cut's key has running mass > its target, and no more than the mass through its bin.
      kept_lo = t_lo + 1;
      kept_hi = min(kept_hi, sh.mass_excl[hi[kWinTopP] + 1]);
      limit_lo = lo[kWinTopP];
      limit_hi = hi[kWinTopP];
    }
    if (kept_hi >= kept_lo && kept_lo > 0) {
      lo[kWinPick] = bin_for(sh.mass_excl, pick_target(rs.uniform, kept_lo), limit_lo);
      hi[kWinPick] = bin_for(sh.mass_excl, pick_target(rs.uniform, kept_hi), limit_hi);
    }
  }
  if (!info.non_finite && rs.n_top > 0) {
    scan_histogram(ws.count + r * kBins, sh.count_excl, sh.scan_u64);
    lo[kWinBest] = 0;
    hi[kWinBest] = bin_for(sh.count_excl, static_cast<u64>(min(rs.n_top, vocab) - 1), kBins - 1);
  }
  if (threadIdx.x != 0) return;
  RowPlan plan{};
  plan.any = 0;
  for (int w = 0; w < kWindows; ++w) {
    plan.lo[w] = lo[w];
    plan.hi[w] = hi[w];
    plan.n[w] = 0;
    plan.any |= lo[w] <= hi[w];
  }
  ws.plans[r] = plan;
}

// grid (chunks per row, n_rows), block kChunkThreads: appends every logit of the chunk whose bin lies in a window of
// the row's plan to that window's list (in no particular order).
__global__ void __launch_bounds__(kChunkThreads) row_gather_kernel(int vocab, int chunk_len, const RowSampling* rows,
                                                                   const float* logits, Workspace ws) {
  __shared__ ReduceScratch rs;
  const int r = blockIdx.y, c = blockIdx.x;
  RowPlan* plan = ws.plans + r;
  if (!plan->any) return;
  int lo[kWindows], hi[kWindows], any_lo = kBins, any_hi = -1;
  for (int w = 0; w < kWindows; ++w) {
    lo[w] = plan->lo[w];
    hi[w] = plan->hi[w];
    if (lo[w] <= hi[w]) {
      any_lo = min(any_lo, lo[w]);
      any_hi = max(any_hi, hi[w]);
    }
  }
  const RowSampling rsamp = rows[r];
  const RowInfo info = row_info(ws.stats + static_cast<int64_t>(r) * ws.blocks, gridDim.x, rs);
  const Binning bn = make_binning(info.max_logit, info.min_logit, rsamp.params.temperature);
  const float* row = logits + static_cast<int64_t>(rsamp.row) * vocab;
  u64* lists = ws.lists + static_cast<int64_t>(r) * kWindows * kGather;
  const bool vec = vector_row(row);
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 4 * kChunkThreads) {
    const int at = base + static_cast<int>(threadIdx.x) * 4;
    const float4 v = load4(row, at, end, vec);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = at + k;
      const int b = i < end ? bin_of(bn, lane_of(v, k)) : -1;
      const bool in_any = any_lo <= b && b <= any_hi;
      if (__ballot_sync(0xffffffffu, in_any) == 0) continue;
      const u64 key = in_any ? make_key(ordered(lane_of(v, k)), i) : 0;
      for (int w = 0; w < kWindows; ++w) {
        const bool take = in_any && lo[w] <= b && b <= hi[w];
        const unsigned m = __ballot_sync(0xffffffffu, take);
        if (m == 0) continue;
        const int leader = __ffs(m) - 1;
        unsigned slot = 0;
        if (lane == leader) slot = atomicAdd(&plan->n[w], static_cast<unsigned>(__popc(m)));
        slot = __shfl_sync(0xffffffffu, slot, leader) + static_cast<unsigned>(__popc(m & ((1u << lane) - 1u)));
        if (take && slot < static_cast<unsigned>(kGather)) lists[w * kGather + slot] = key;
      }
    }
  }
}

// ---- kernel 5: the cuts and the pick ------------------------------------------------------------------------------
// grid (n_rows), block kPickThreads; writes out[r] for rows[r].
__global__ void __launch_bounds__(kPickThreads) row_pick_kernel(int vocab, int n_chunks, const RowSampling* rows,
                                                                const float* logits, Workspace ws, RowSample* out) {
  __shared__ PickShared sh;
  const int64_t r = blockIdx.x;
  const RowSampling rs = rows[r];
  RowSample* o = out + r;
  const RowInfo info = row_info(ws.stats + r * ws.blocks, n_chunks, sh.rs);
  if (info.non_finite) {  // the engine fails this request: no id, no logprobs
    if (threadIdx.x == 0) {
      o->token = -1;
      o->finite = false;
      o->n_top = 0;
      o->logprob = 0.0f;
    }
    return;
  }
  if (threadIdx.x == 0) sh.plan = ws.plans[r];
  __syncthreads();
  const float* row_logits = logits + static_cast<int64_t>(rs.row) * vocab;
  const RowCtx row{row_logits,
                   vocab,
                   make_binning(info.max_logit, info.min_logit, rs.params.temperature),
                   static_cast<double>(info.max_logit),
                   1.0 / static_cast<double>(rs.params.temperature),
                   vector_row(row_logits),
                   &sh.plan,
                   ws.lists + r * kWindows * kGather};
  int token = key_index(info.best);
  if (rs.params.temperature > 0.0f) token = params_ok(rs) ? sample_row(rs, row, r, ws, sh) : -1;
  if (threadIdx.x == 0) {
    o->token = token;
    o->finite = true;
    o->n_top = 0;
    o->logprob = 0.0f;
  }
  if (rs.n_top < 0 || token < 0) return;
  // log-softmax (double, as top_logprobs_cpu) at the token and at the n_top best keys. log Z: the per-block partials
  // summed in block order (the same sum whatever the chunking).
  const int n = min(rs.n_top, vocab);
  if (n > 0) {
    scan_histogram(ws.count + r * kBins, sh.count_excl, sh.scan_u64);
    best_keys(row, sh.count_excl, n, sh);
  }
  if (threadIdx.x != 0) return;
  double z = 0.0;
  for (int b = 0; b < ws.blocks; ++b) z += ws.z[r * ws.blocks + b];
  const double log_z = static_cast<double>(info.max_logit) + log(z);
  for (int a = 0; a < n; ++a) {
    const int id = key_index(sh.top_keys[a]);
    o->top_ids[a] = id;
    o->top_logprobs[a] = static_cast<float>(static_cast<double>(row.logits[id]) - log_z);
  }
  o->n_top = n;
  o->logprob = static_cast<float>(static_cast<double>(row.logits[token]) - log_z);
}

void check_batch(const SamplingBatch& b, const char* who) {
  BG_CHECK(b.n_rows >= 0 && b.n_rows < (int64_t{1} << 16), "{}: bad n_rows {}", who, b.n_rows);
  BG_CHECK(b.vocab > 0 && b.vocab <= kSamplingMaxVocab, "{}: vocab {} outside [1, {}]", who, b.vocab,
           kSamplingMaxVocab);
}

}  // namespace

size_t sample_rows_workspace_bytes(const SamplingBatch& b) {
  check_batch(b, "sample_rows_workspace_bytes");
  return workspace_bytes(b.n_rows, b.vocab);
}

void sample_rows_cuda(const SamplingBatch& b, const RowSampling* rows, const float* logits, RowSample* out,
                      void* workspace, size_t workspace_size, cudaStream_t stream) {
  check_batch(b, "sample_rows_cuda");
  if (b.n_rows == 0) return;
  BG_CHECK(rows && logits && out && workspace, "sample_rows_cuda: null pointer with n_rows {}", b.n_rows);
  BG_CHECK(workspace_size >= workspace_bytes(b.n_rows, b.vocab),
           "sample_rows_cuda: workspace of {} bytes, {} needed for {} rows of {}", workspace_size,
           workspace_bytes(b.n_rows, b.vocab), b.n_rows, b.vocab);
  const Workspace ws = carve(workspace, b.n_rows, b.vocab);
  const int vocab = static_cast<int>(b.vocab);
  const int chunk_len = blocks_per_chunk(b.n_rows, b.vocab) * kBlock;
  const int n_chunks = (vocab + chunk_len - 1) / chunk_len;
  const dim3 grid(static_cast<unsigned>(n_chunks), static_cast<unsigned>(b.n_rows));
  row_stats_kernel<<<grid, kChunkThreads, 0, stream>>>(vocab, chunk_len, rows, logits, ws);
  BG_CUDA_CHECK_LAUNCH();
  row_histogram_kernel<<<grid, kChunkThreads, 0, stream>>>(vocab, chunk_len, rows, logits, ws);
  BG_CUDA_CHECK_LAUNCH();
  row_plan_kernel<<<static_cast<unsigned>(b.n_rows), kPickThreads, 0, stream>>>(vocab, n_chunks, rows, ws);
  BG_CUDA_CHECK_LAUNCH();
  row_gather_kernel<<<grid, kChunkThreads, 0, stream>>>(vocab, chunk_len, rows, logits, ws);
  BG_CUDA_CHECK_LAUNCH();
  row_pick_kernel<<<static_cast<unsigned>(b.n_rows), kPickThreads, 0, stream>>>(vocab, n_chunks, rows, logits, ws, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

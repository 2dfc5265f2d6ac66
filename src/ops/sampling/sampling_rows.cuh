// The sampler's row model, shared by its kernels (sampling_cuda.cu; design there and in docs/PERF.md, "Sampling"):
// sizes, the workspace layout and window plan, order-preserving keys, the fixed-point weight, the value bins, and a
// row's statistics. Device code in an anonymous namespace: included only by sampling_cuda.cu (after its includes).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "ops/elementwise/cuda_utils.cuh"
#include "ops/sampling/sampling.h"
#include "ops/sampling/sampling_weight.h"

namespace bg::ops {
namespace {

using u64 = unsigned long long;

constexpr int kBins = 2048;                      // value bins per row; the last also takes all past the span
constexpr int kBlock = 1024;                     // logits per block: chunks are whole blocks
constexpr int kChunkThreads = 256;               // row_stats, row_histogram and row_plan
constexpr int kPickThreads = 512;                // row_pick
constexpr int kGather = 2048;                    // the most candidates of one bin resolved in shared memory
constexpr int kTargetCtas = 1024;                // chunks per row: about eight CTAs per SM over the batch
// A probability p in [0, 1] weighs rint(p * 2^44) (mass_weight, sampling_weight.h): 0 from 31.5 nats below the max.
constexpr float kSpanNats = 32.0f;               // bins cover at most 32 nats (at the temperature) below the max
// Fixed-point mass: at most kSamplingMaxVocab (2^19) * 2^44 = 2^63 in total, so u64 sums never overflow.

// Per chunk of a row (row_stats).
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
// bins 0..B holding a top-k row's k best (every cut of such a row lies among them), the bins the top-p cut and the pick
// of a row without top-k can fall in (bounded from the mass histogram before the top-p cut is exact), and bins 0..B
// holding the n_top best.
enum Window { kWinTopK, kWinTopP, kWinPick, kWinBest, kWindows };

// A row's statistics (row_info).
struct RowInfo {
  u64 best;
  float max_logit, min_logit;
  bool non_finite;
};

struct RowPlan {
  int lo[kWindows], hi[kWindows];  // bin ranges; lo > hi: none
  unsigned n[kWindows];            // candidates appended (> kGather: too many; only the count is right)
  int any;                         // some window is set
  RowInfo info;                    // row_plan's row_info, for row_gather and row_pick (no second reduction)
};

// The workspace of n_rows entries: [ChunkStat x blocks][u64 Z][u64 mass x kBins][u64 keys x kGather x kWindows]
// [RowPlan] per row, each array over all rows.
struct Workspace {
  ChunkStat* stats;
  u64* z;  // per row: the sum of rint(exp(l - max) * 2^44) over the row (log Z for logprobs; exact, order-free)
  u64* mass;
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
  w.z = reinterpret_cast<u64*>(p);
  p += n_rows * static_cast<int64_t>(sizeof(u64));
  w.mass = reinterpret_cast<u64*>(p);
  p += n_rows * kBins * static_cast<int64_t>(sizeof(u64));
  w.lists = reinterpret_cast<u64*>(p);
  p += n_rows * kWindows * kGather * static_cast<int64_t>(sizeof(u64));
  w.plans = reinterpret_cast<RowPlan*>(p);
  return w;
}

size_t workspace_bytes(int64_t n_rows, int64_t vocab) {
  const int64_t per_row = blocks_of(vocab) * static_cast<int64_t>(sizeof(ChunkStat)) +
                          static_cast<int64_t>(sizeof(u64)) + kBins * static_cast<int64_t>(sizeof(u64)) +
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

// The fixed-point weight exp((l - max) / T) * 2^44 (sampling_weight.h, within about half an ulp of the double exp
// before the rounding, as the CPU's std::exp), with the division by T done as a product with 1 / T (exact at T = 1;
// elsewhere within an ulp of x, far below the 2^-44 rounding of the weight). `exp2` is the kernel's shared copy of
// kExp2Table (load_exp2).
__device__ __forceinline__ u64 mass_of(float l, double max_logit, double inv_temperature, const Exp2Entry* exp2) {
  return mass_weight((static_cast<double>(l) - max_logit) * inv_temperature, exp2);
}

__constant__ Exp2Entry c_exp2[kExp2Steps] = BG_SAMPLING_EXP2_TABLE;

// Copies kExp2Table into shared memory (indices vary per lane, which constant memory would serialise); the caller
// synchronises before the first mass_of.
__device__ __forceinline__ void load_exp2(Exp2Entry* dst) {
  for (int j = threadIdx.x; j < kExp2Steps; j += blockDim.x) dst[j] = c_exp2[j];
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

struct ReduceScratch {
  u64 u64s[32];
  unsigned u32s[32];
  int ints[32];
};

// A row's statistics, reduced over its chunk stats by a whole block (every thread gets them).
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

// What row_histogram must sum for a row: the mass histogram of a sampling row (at its temperature) and of a row asking
// for alternatives (at temperature 1: the window of its n best comes from it, row_plan), and Z for logprobs.
struct RowNeeds {
  bool sample, mass, log_z;
};

__device__ __forceinline__ bool params_ok(const RowSampling& rs) {
  const SamplingParams& p = rs.params;
  return p.top_p > 0.0f && p.top_p <= 1.0f && p.top_k >= 0 && rs.uniform >= 0.0 && rs.uniform < 1.0;
}

__device__ __forceinline__ RowNeeds needs_of(const RowSampling& rs) {
  const bool sample = rs.params.temperature > 0.0f && params_ok(rs);
  return {sample, sample || rs.n_top > 0, rs.n_top >= 0};
}

// 1 / the temperature of a row's mass weights: the sampling temperature, 1 for a greedy row.
__device__ __forceinline__ double mass_inv_temperature(const RowSampling& rs) {
  return rs.params.temperature > 0.0f ? 1.0 / static_cast<double>(rs.params.temperature) : 1.0;
}

}  // namespace
}  // namespace bg::ops

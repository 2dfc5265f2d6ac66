// CUDA sampling of one step's rows in five kernels over a workspace, so that a row spreads over many CTAs and the
// logits are read three times (statistics, histogram, candidates) by the whole GPU:
//   1. row_stats: per chunk of a row, the largest key, the smallest finite logit and a non-finite flag; clears the
//      row's histogram and Z.
//   2. row_histogram: per chunk, every logit's value bin (monotone in the logit: a bin is a contiguous run of the
//      CPU's sorted order) summed into the row's histogram of fixed-point mass, and the row's fixed-point Z (logprobs).
//   3. row_plan (plan_row): one CTA per row bounds, from the mass histogram alone, the bins the cuts can fall in: for
//      a top-k row the bins 0..B that surely hold its k best (counts bounded from the mass), else those of the top-p
//      cut and the pick (each target is monotone in the kept mass); for logprobs the bins 0..B that hold the n best.
//   4. row_gather: per chunk, every logit whose bin lies in such a window is appended to that window's list.
//   5. row_pick: one CTA per row. A top-k row sorts its window's list and makes its three cuts in one scan; otherwise
//      it walks the histogram to the bin holding each cut, takes that bin's candidates from a window's list (or, when
//      no window holds them, from a pass over the row), sorts them in shared memory and scans their weights. A bin too
//      large for shared memory falls back to a radix descent over the row; a window that holds too few or too many
//      logits, to exact counts from a pass over the row.
// Keys: the order-preserving logit bits, then the inverted index, so that descending key order is exactly the CPU's
// (logit descending, lower index first; -0 and +0 tie). Probabilities are 2^-44 fixed point: integer sums are exact and
// order-free, so the histograms, the cuts and the ids do not depend on how the row was split. The row model (sizes,
// workspace, keys, weights, bins) is sampling_rows.cuh; the cut resolution of row_pick is sampling_cuts.cuh.
#include "ops/sampling/sampling_cuda.h"

#include <algorithm>
#include <cstddef>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/sampling/sampling_cuts.cuh"
#include "ops/sampling/sampling_rows.cuh"

namespace bg::ops {
namespace {

// ---- kernel 1: chunk statistics ------------------------------------------------------------------------------------
// grid (chunks per row, n_rows), block kChunkThreads. Per logit three cheap operations: the running max with its first
// index (a thread sees its indices in increasing order, so a strict > keeps the lowest index of equal logits, -0 and +0
// tie), the running min, and l * 0 summed (0 for every finite logit, NaN once one is not). The key of the max is made
// once per thread.
__global__ void __launch_bounds__(kChunkThreads)
    row_stats_kernel(int vocab, int chunk_len, const RowSampling* rows, const float* logits, Workspace ws) {
  __shared__ ReduceScratch rs;
  const int r = blockIdx.y, c = blockIdx.x, n_chunks = gridDim.x;
  const float* row = logits + static_cast<int64_t>(rows[r].row) * vocab;
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const bool vec = vector_row(row);
  float best_l = -INFINITY, min_l = INFINITY, poison = 0.0f;
  int best_i = -1;
  constexpr int kVecs = 4;  // float4 loads in flight per thread
  for (int base = begin; base < end; base += 4 * kVecs * kChunkThreads) {
    float4 v[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
      v[u] = load4(row, base + (u * kChunkThreads + static_cast<int>(threadIdx.x)) * 4, end, vec);
    const bool full = base + 4 * kVecs * kChunkThreads <= end;
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = base + (u * kChunkThreads + static_cast<int>(threadIdx.x)) * 4 + k;
        if (!full && i >= end) continue;
        const float l = lane_of(v[u], k);
        poison = fmaf(l, 0.0f, poison);
        min_l = fminf(min_l, l);
        if (l > best_l) {
          best_l = l;
          best_i = i;
        }
      }
    }
  }
  // Non-finite logits make the row fail (row_info), so max and min need only be right when every logit is finite.
  const bool finite = poison == 0.0f;
  u64 best = finite && best_i >= 0 ? make_key(ordered(best_l), best_i) : 0;
  unsigned min_ord = finite && best_i >= 0 ? ordered(min_l) : 0xffffffffu;
  int non_finite = finite ? 0 : 1;
  best = cuda_util::block_reduce(best, cuda_util::MaxOp{}, u64{0}, rs.u64s);
  min_ord = cuda_util::block_reduce(min_ord, cuda_util::MinOp{}, 0xffffffffu, rs.u32s);
  non_finite = cuda_util::block_reduce(non_finite, cuda_util::MaxOp{}, 0, rs.ints);
  if (threadIdx.x == 0) ws.stats[static_cast<int64_t>(r) * ws.blocks + c] = {best, min_ord, non_finite};
  // This chunk's share of the row's histograms starts at zero (row_histogram adds to them).
  u64* mass = ws.mass + static_cast<int64_t>(r) * kBins;
  const int bin_begin = c * kBins / n_chunks, bin_end = (c + 1) * kBins / n_chunks;
  for (int b = bin_begin + static_cast<int>(threadIdx.x); b < bin_end; b += kChunkThreads) mass[b] = 0;
  if (c == 0 && threadIdx.x == 0) ws.z[r] = 0;  // and so does the row's Z
}

// ---- kernel 2: the mass histogram and Z -----------------------------------------------------------------------------
// The mass histogram in shared memory as two 32-bit words per bin (there is no native 64-bit shared atomic add; its
// compare-and-swap loop was most of this kernel's time): low 32 bits, and the units of 2^32 (the weight's high bits
// plus the carries out of the low word, detected from the value the add returned). Both sums are exact integers. Shared
// atomics bound this kernel on the H200 (about two lanes' adds per clock per SM): there is no count histogram (plan_row
// bounds counts from the mass), and a logit of weight 0 adds nothing.
struct HistShared {
  unsigned mass_lo[kBins];
  unsigned mass_hi[kBins];
};

// The chunk's logits into the shared histogram (and into the row's Z), for a row's needs known at compile time so the
// per-logit path has no flag tests: kMass, the mass (mass_of at the row's mass temperature); kLogZ, Z: the same
// fixed-point weight at temperature 1 (kZIsMass: the mass itself, when that temperature is 1), summed per thread, per
// CTA, then added to the row's total with one atomic per CTA. Integer sums: Z is the same whatever the chunking (batch
// invariant), and within 163840 * 2^-45 of the exact sum, whose largest term is 1 (log Z off by < 5e-9).
template <bool kMass, bool kLogZ, bool kZIsMass>
__device__ __forceinline__ void histogram_chunk(const float* row, bool vec, int begin, int end, const Binning& bn,
                                                double max_logit, double inv_temperature, HistShared& sh,
                                                ReduceScratch& rs, const Exp2Entry* exp2, u64* z_out) {
  static_assert(kMass || !kZIsMass);
  u64 z = 0;
  const int at = static_cast<int>(threadIdx.x) * 4;
  float4 next = load4(row, begin + at, end, vec);
  for (int blk = begin; blk < end; blk += 4 * kChunkThreads) {
    const float4 cur = next;
    if (blk + 4 * kChunkThreads < end) next = load4(row, blk + 4 * kChunkThreads + at, end, vec);
    const bool full = blk + 4 * kChunkThreads <= end;  // no entry past the row: no per-entry check
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = blk + at + k;
      if (!full && i >= end) continue;
      const float l = lane_of(cur, k);
      [[maybe_unused]] u64 w = 0;
      if constexpr (kMass) {
        w = mass_of(l, max_logit, inv_temperature, exp2);
        if (w != 0) {
          const int b = bin_of(bn, l);
          const auto lo = static_cast<unsigned>(w);
          const unsigned units = static_cast<unsigned>(w >> 32) + (atomicAdd(&sh.mass_lo[b], lo) + lo < lo ? 1u : 0u);
          if (units != 0) atomicAdd(&sh.mass_hi[b], units);
        }
      }
      if constexpr (kLogZ) z += kZIsMass ? w : mass_of(l, max_logit, 1.0, exp2);
    }
  }
  if constexpr (kLogZ) {
    z = cuda_util::block_reduce(z, cuda_util::SumOp{}, u64{0}, rs.u64s);
    if (threadIdx.x == 0 && z != 0) atomicAdd(z_out, z);
  }
}

// ---- kernel 3: the row's plan, the windows of row_gather ------------------------------------------------------------
struct PlanShared {
  u64 mass_excl[kBins + 1];
  u64 scan_u64[kChunkThreads / 32];
  int found_bin;
};

// The shared memory of row_histogram (the histogram) and of row_plan (the prefix sums).
struct RowShared {
  union {
    HistShared hist;
    PlanShared plan;
  };
  ReduceScratch rs;
  Exp2Entry exp2[kExp2Steps];
};

// The bound of bin b (see bin_holding_at_least): at least this many logits lie in it.
__device__ __forceinline__ u64 count_at_least(const Binning& bn, double inv_temperature, int b, const u64* excl,
                                              const Exp2Entry* exp2) {
  const u64 mass = excl[b + 1] - excl[b];
  if (mass == 0) return 0;
  const double d_min = b == 0 ? 0.0 : static_cast<double>(b) / static_cast<double>(bn.scale) * (1.0 - 0x1p-20);
  const double w_max = mass_exp(-d_min * inv_temperature, exp2) * (1.0 + 0x1p-40) + 1.0;
  const double at_least = ceil(static_cast<double>(mass) / w_max - 1e-6);
  return at_least > 0.0 ? static_cast<u64>(at_least) : 0;
}

// The smallest bin B such that bins 0..B surely hold at least n logits, from the mass histogram alone (no count
// histogram is kept): a logit of bin b lies at least b / scale below the max (less a margin for the rounding of d and
// of the scale), so it weighs at most wmax(b), and bin b holds at least ceil(mass(b) / wmax(b)) logits -- exactly its
// count when it holds fewer than ~64 (a bin spans at most 1/64 nat at the temperature, so its weights differ by under
// 1.6 %). kBins - 1 when the bound never reaches n (weights of 0 say nothing). An under-estimate only widens the
// window; row_pick checks the gathered count and falls back to exact counts when a window holds too few or too many.
__device__ __noinline__ int bin_holding_at_least(const Binning& bn, double inv_temperature, u64 n, RowShared& sh) {
  const u64* excl = sh.plan.mass_excl;
  // Warp 0 tries the first bins, 32 at a time (a window near the top usually ends there) ...
  constexpr int kWarpBins = 64;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    u64 run = 0;
    int found = -1;
    for (int base = 0; base < kWarpBins; base += 32) {
      u64 incl = count_at_least(bn, inv_temperature, base + lane, excl, sh.exp2);
      for (int o = 1; o < 32; o <<= 1) {
        const u64 other = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += other;
      }
      const unsigned reached = __ballot_sync(0xffffffffu, run + incl >= n);
      if (reached != 0) {
        found = base + __ffs(reached) - 1;
        break;
      }
      run += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) sh.plan.found_bin = found;
  }
  __syncthreads();
  int found = sh.plan.found_bin;
  __syncthreads();
  if (found >= 0) return found;
  // ... else the whole block bounds every bin and scans them.
  constexpr int kPer = kBins / kChunkThreads;
  u64 lb[kPer];
  u64 sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    lb[k] = count_at_least(bn, inv_temperature, static_cast<int>(threadIdx.x) * kPer + k, excl, sh.exp2);
    sum += lb[k];
  }
  if (threadIdx.x == 0) sh.plan.found_bin = kBins - 1;
  u64 total = 0;
  u64 run = block_exclusive_scan(sum, sh.plan.scan_u64, &total);  // synchronises: found_bin is set
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (run < n && run + lb[k] >= n) atomicMin(&sh.plan.found_bin, static_cast<int>(threadIdx.x) * kPer + k);
    run += lb[k];
  }
  __syncthreads();
  found = sh.plan.found_bin;
  __syncthreads();
  return found;
}

// A row's RowPlan (all threads of a kChunkThreads block): its windows (none for rows row_pick resolves without) and its
// statistics. For a top-k row, the bins 0..B that hold its k best (every cut of the row lies among them); else the bins
// the top-p cut and the pick can fall in; for a row asking for alternatives, the bins that hold its n best.
__device__ __forceinline__ void plan_row(int vocab, int n_chunks, const RowSampling* rows, const ChunkStat* stats,
                                         const u64* row_mass, RowPlan* out, RowShared& sh) {
  const RowSampling rs = *rows;
  const RowInfo info = row_info(stats, n_chunks, sh.rs);
  const RowNeeds need = needs_of(rs);
  int lo[kWindows], hi[kWindows];
  for (int w = 0; w < kWindows; ++w) {
    lo[w] = 1;
    hi[w] = 0;
  }
  if (!info.non_finite && need.mass) {
    scan_histogram<u64, kChunkThreads>(row_mass, sh.plan.mass_excl, sh.plan.scan_u64);
    const u64* excl = sh.plan.mass_excl;
    const Binning bn = make_binning(info.max_logit, info.min_logit, rs.params.temperature);
    const double inv_temperature = mass_inv_temperature(rs);
    const SamplingParams& sp = rs.params;
    if (need.sample && sp.top_k > 0 && sp.top_k < vocab) {
      lo[kWinTopK] = 0;
      hi[kWinTopK] = bin_holding_at_least(bn, inv_temperature, static_cast<u64>(sp.top_k), sh);
    } else if (need.sample) {
      // Bounds on the kept mass and on the bin limit before each cut.
      u64 kept_lo = excl[kBins], kept_hi = kept_lo;
      int limit_lo = kBins - 1, limit_hi = kBins - 1;
      if (sp.top_p < 1.0f) {
        const u64 t_lo = top_p_target(sp.top_p, kept_lo), t_hi = top_p_target(sp.top_p, kept_hi);
        lo[kWinTopP] = bin_for(excl, t_lo, limit_lo);
        hi[kWinTopP] = bin_for(excl, t_hi, limit_hi);
        // The cut's key has running mass > its target, and no more than the mass through its bin.
        kept_lo = t_lo + 1;
        kept_hi = min(kept_hi, excl[hi[kWinTopP] + 1]);
        limit_lo = lo[kWinTopP];
        limit_hi = hi[kWinTopP];
      }
      if (kept_hi >= kept_lo && kept_lo > 0) {
        lo[kWinPick] = bin_for(excl, pick_target(rs.uniform, kept_lo), limit_lo);
        hi[kWinPick] = bin_for(excl, pick_target(rs.uniform, kept_hi), limit_hi);
      }
    }
    if (rs.n_top > 0) {
      lo[kWinBest] = 0;
      hi[kWinBest] = bin_holding_at_least(bn, inv_temperature, static_cast<u64>(min(rs.n_top, vocab)), sh);
    }
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
  plan.info = info;
  *out = plan;
}

// Chunk c of row r into the row's mass histogram and Z (row_histogram's body).
__device__ __forceinline__ void chunk_sums(int vocab, int chunk_len, const RowSampling* rows, const float* logits,
                                           const Workspace& ws, int r, int c, RowShared& sh) {
  const RowSampling rsamp = rows[r];
  const RowNeeds need = needs_of(rsamp);
  if (!need.mass && !need.log_z) return;  // greedy without logprobs: row_pick needs the max only
  const RowInfo info = row_info(ws.stats + static_cast<int64_t>(r) * ws.blocks, gridDim.x, sh.rs);
  if (info.non_finite) return;
  const float* row = logits + static_cast<int64_t>(rsamp.row) * vocab;
  const Binning bn = make_binning(info.max_logit, info.min_logit, rsamp.params.temperature);
  const double max_logit = info.max_logit, inv_temperature = mass_inv_temperature(rsamp);
  const bool vec = vector_row(row);
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) {
    sh.hist.mass_lo[b] = 0;
    sh.hist.mass_hi[b] = 0;
  }
  __syncthreads();
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  u64* z = ws.z + r;
  const auto run = [&]<bool kMass, bool kLogZ, bool kZIsMass>() {
    histogram_chunk<kMass, kLogZ, kZIsMass>(row, vec, begin, end, bn, max_logit, inv_temperature, sh.hist, sh.rs,
                                            sh.exp2, z);
  };
  if (!need.mass) {
    run.template operator()<false, true, false>();
  } else if (!need.log_z) {
    run.template operator()<true, false, false>();
  } else if (inv_temperature == 1.0) {
    run.template operator()<true, true, true>();
  } else {
    run.template operator()<true, true, false>();
  }
  if (!need.mass) return;
  __syncthreads();
  u64* mass = ws.mass + static_cast<int64_t>(r) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) {
    const u64 m = (static_cast<u64>(sh.hist.mass_hi[b]) << 32) + sh.hist.mass_lo[b];
    if (m != 0) atomicAdd(&mass[b], m);
  }
}

// grid (chunks per row, n_rows), block kChunkThreads; eight CTAs per SM (32 registers, 19 KB of shared memory each), so
// the ~1024 CTAs of a step run in one wave. (Planning the row in the last CTA to finish, instead of in a kernel of its
// own, spilled this loop's registers: 150 MB of local traffic at B = 64 on the H200.)
__global__ void __launch_bounds__(kChunkThreads, 8)
    row_histogram_kernel(int vocab, int chunk_len, const RowSampling* rows, const float* logits, Workspace ws) {
  __shared__ RowShared sh;
  load_exp2(sh.exp2);  // row_info synchronises before the first use
  chunk_sums(vocab, chunk_len, rows, logits, ws, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x), sh);
}

// grid (n_rows), block kChunkThreads: ws.plans[r] (plan_row).
__global__ void __launch_bounds__(kChunkThreads)
    row_plan_kernel(int vocab, int n_chunks, const RowSampling* rows, Workspace ws) {
  __shared__ RowShared sh;
  const int64_t r = blockIdx.x;
  load_exp2(sh.exp2);  // row_info synchronises before the first use
  plan_row(vocab, n_chunks, rows + r, ws.stats + r * ws.blocks, ws.mass + r * kBins, ws.plans + r, sh);
}

// ---- kernel 4: the candidates of the windows ------------------------------------------------------------------------

// grid (chunks per row, n_rows), block kChunkThreads: appends every logit of the chunk whose bin lies in a window of
// the row's plan to that window's list (in no particular order). Which windows hold a bin is a byte per bin in shared
// memory, so a logit outside every window costs its bin and one shared load (the windows' hull, tested before, could
// span most of the row when the top-p and pick windows lay far apart: then every warp took the per-window path).
__global__ void __launch_bounds__(kChunkThreads)
    row_gather_kernel(int vocab, int chunk_len, const RowSampling* rows, const float* logits, Workspace ws) {
  __shared__ unsigned char windows_of[kBins];
  const int r = blockIdx.y, c = blockIdx.x;
  RowPlan* plan = ws.plans + r;
  if (!plan->any) return;
  int lo[kWindows], hi[kWindows];
  for (int w = 0; w < kWindows; ++w) {
    lo[w] = plan->lo[w];
    hi[w] = plan->hi[w];
  }
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) {
    unsigned m = 0;
    for (int w = 0; w < kWindows; ++w) m |= (lo[w] <= b && b <= hi[w] ? 1u : 0u) << w;
    windows_of[b] = static_cast<unsigned char>(m);
  }
  const RowSampling rsamp = rows[r];
  const RowInfo info = plan->info;
  __syncthreads();  // windows_of is complete
  const Binning bn = make_binning(info.max_logit, info.min_logit, rsamp.params.temperature);
  const float* row = logits + static_cast<int64_t>(rsamp.row) * vocab;
  u64* lists = ws.lists + static_cast<int64_t>(r) * kWindows * kGather;
  const bool vec = vector_row(row);
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const int lane = threadIdx.x & 31;
  float4 next = load4(row, begin + static_cast<int>(threadIdx.x) * 4, end, vec);  // one load ahead, as row_histogram
  for (int base = begin; base < end; base += 4 * kChunkThreads) {
    const int at = base + static_cast<int>(threadIdx.x) * 4;
    const float4 v = next;
    if (base + 4 * kChunkThreads < end) next = load4(row, at + 4 * kChunkThreads, end, vec);
    const bool full = base + 4 * kChunkThreads <= end;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = at + k;
      const unsigned m = full || i < end ? windows_of[bin_of(bn, lane_of(v, k))] : 0u;
      if (__ballot_sync(0xffffffffu, m != 0) == 0) continue;
      const u64 key = m != 0 ? make_key(ordered(lane_of(v, k)), i) : 0;
      for (int w = 0; w < kWindows; ++w) {
        const bool take = (m >> w) & 1u;
        const unsigned taken = __ballot_sync(0xffffffffu, take);
        if (taken == 0) continue;
        const int leader = __ffs(taken) - 1;
        unsigned slot = 0;
        if (lane == leader) slot = atomicAdd(&plan->n[w], static_cast<unsigned>(__popc(taken)));
        slot = __shfl_sync(0xffffffffu, slot, leader) + static_cast<unsigned>(__popc(taken & ((1u << lane) - 1u)));
        if (take && slot < static_cast<unsigned>(kGather)) lists[w * kGather + slot] = key;
      }
    }
  }
}

// ---- kernel 5: the cuts and the pick ------------------------------------------------------------------------------
// grid (n_rows), block kPickThreads; writes out[r] for rows[r].
__global__ void __launch_bounds__(kPickThreads)
    row_pick_kernel(int vocab, const RowSampling* rows, const float* logits, Workspace ws, RowSample* out) {
  __shared__ PickShared sh;
  const int64_t r = blockIdx.x;
  const RowSampling rs = rows[r];
  RowSample* o = out + r;
  const RowInfo info = ws.plans[r].info;  // row_plan's
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
  load_exp2(sh.exp2);
  __syncthreads();
  const float* row_logits = logits + static_cast<int64_t>(rs.row) * vocab;
  const RowCtx row{row_logits,
                   vocab,
                   make_binning(info.max_logit, info.min_logit, rs.params.temperature),
                   static_cast<double>(info.max_logit),
                   mass_inv_temperature(rs),
                   vector_row(row_logits),
                   &sh.plan,
                   ws.lists + r * kWindows * kGather,
                   sh.exp2};
  const u64 z = ws.z[r];  // read early (row_histogram's; used at the end)
  u64 token_key = info.best;
  if (rs.params.temperature > 0.0f) token_key = params_ok(rs) ? sample_row(rs, row, r, ws, sh) : 0;
  const int token = token_key == 0 ? -1 : key_index(token_key);
  const float token_logit = key_logit(token_key);
  if (threadIdx.x == 0) {
    o->token = token;
    o->finite = true;
    o->n_top = 0;
    o->logprob = 0.0f;
  }
  if (rs.n_top < 0 || token < 0) return;
  // log-softmax (double, as top_logprobs_cpu) at the token and at the n_top best keys, one per lane of warp 0. Z is
  // row_histogram's fixed-point sum (2^-44 units).
  const int n = min(rs.n_top, vocab);
  if (n > 0) best_keys(row, n, sh);
  if (threadIdx.x >= 32) return;
  const double log_z = static_cast<double>(info.max_logit) + log(ldexp(static_cast<double>(z), -kMassScaleExponent));
  const int a = static_cast<int>(threadIdx.x);
  if (a < n) {  // a key holds its logit's bits: no second read of the row
    const u64 key = sh.top_keys[a];
    o->top_ids[a] = key_index(key);
    o->top_logprobs[a] = static_cast<float>(static_cast<double>(key_logit(key)) - log_z);
  }
  if (a == 0) {
    o->n_top = n;
    o->logprob = static_cast<float>(static_cast<double>(token_logit) - log_z);
  }
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
  row_plan_kernel<<<static_cast<unsigned>(b.n_rows), kChunkThreads, 0, stream>>>(vocab, n_chunks, rows, ws);
  BG_CUDA_CHECK_LAUNCH();
  row_gather_kernel<<<grid, kChunkThreads, 0, stream>>>(vocab, chunk_len, rows, logits, ws);
  BG_CUDA_CHECK_LAUNCH();
  row_pick_kernel<<<static_cast<unsigned>(b.n_rows), kPickThreads, 0, stream>>>(vocab, rows, logits, ws, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

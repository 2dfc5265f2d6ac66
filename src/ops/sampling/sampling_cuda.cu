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
  unsigned* count = ws.count + static_cast<int64_t>(r) * kBins;
  const int bin_begin = c * kBins / n_chunks, bin_end = (c + 1) * kBins / n_chunks;
  for (int b = bin_begin + static_cast<int>(threadIdx.x); b < bin_end; b += kChunkThreads) {
    mass[b] = 0;
    count[b] = 0;
  }
}

// ---- kernel 2: histograms and log Z partials -----------------------------------------------------------------------
// The mass histogram in shared memory as two 32-bit words per bin (there is no native 64-bit shared atomic add; its
// compare-and-swap loop was most of this kernel's time): low 32 bits, and the units of 2^32 (the weight's high bits
// plus the carries out of the low word, detected from the value the add returned). Both sums are exact integers.
struct HistShared {
  unsigned mass_lo[kBins];
  unsigned mass_hi[kBins];
  unsigned count[kBins];
  double z[kChunkThreads / 32];
  ReduceScratch rs;
  Exp2Entry exp2[kExp2Steps];
};

// The chunk's logits into the shared histograms (and the log Z partials), for a row's needs known at compile time so
// the per-logit path has no flag tests: kSample, the mass (mass_of); kCounts, the counts; kLogZ, the partials.
template <bool kSample, bool kCounts, bool kLogZ>
__device__ __forceinline__ void histogram_chunk(const float* row, bool vec, int begin, int end, const Binning& bn,
                                                double max_logit, double inv_temperature, HistShared& sh,
                                                double* z_out) {
  // One kBlock at a time (four logits per thread), so that the log Z partial of each block is the same whatever the
  // chunking; the next block's logits are loaded before this block's are processed.
  static_assert(kBlock == 4 * kChunkThreads);
  const int at = static_cast<int>(threadIdx.x) * 4;
  float4 next = load4(row, begin + at, end, vec);
  for (int blk = begin; blk < end; blk += kBlock) {
    const float4 cur = next;
    if (blk + kBlock < end) next = load4(row, blk + kBlock + at, end, vec);
    const bool full = blk + kBlock <= end;  // no entry of the block past the row: no per-entry check
    double z = 0.0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = blk + at + k;
      if (!full && i >= end) continue;
      const float l = lane_of(cur, k);
      if constexpr (kSample || kCounts) {
        const int b = bin_of(bn, l);
        if constexpr (kCounts) atomicAdd(&sh.count[b], 1u);
        if constexpr (kSample) {
          const u64 w = mass_of(l, max_logit, inv_temperature, sh.exp2);
          const auto lo = static_cast<unsigned>(w);
          const unsigned units = static_cast<unsigned>(w >> 32) + (atomicAdd(&sh.mass_lo[b], lo) + lo < lo ? 1u : 0u);
          if (units != 0) atomicAdd(&sh.mass_hi[b], units);
        }
      }
      if constexpr (kLogZ) z += exp(static_cast<double>(l) - max_logit);
    }
    if constexpr (kLogZ) {
      z = cuda_util::block_reduce(z, cuda_util::SumOp{}, 0.0, sh.z);
      if (threadIdx.x == 0) z_out[blk / kBlock] = z;
    }
  }
}

// grid (chunks per row, n_rows), block kChunkThreads; eight CTAs per SM (32 registers, 27 KB of shared memory each),
// so the ~1024 CTAs of a step run in one wave.
__global__ void __launch_bounds__(kChunkThreads, 8)
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
    sh.mass_lo[b] = 0;
    sh.mass_hi[b] = 0;
    sh.count[b] = 0;
  }
  load_exp2(sh.exp2);
  __syncthreads();
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  double* z = ws.z + static_cast<int64_t>(r) * ws.blocks;
  // The combinations the engine sends: top_p (sample), top_k + top_p (sample, counts), with logprobs (log Z, and
  // counts for the alternatives), and logprobs of a greedy row.
  const auto run = [&]<bool kS, bool kC, bool kZ>() {
    histogram_chunk<kS, kC, kZ>(row, vec, begin, end, bn, max_logit, inv_temperature, sh, z);
  };
  if (need.sample) {
    if (need.counts) {
      need.log_z ? run.template operator()<true, true, true>() : run.template operator()<true, true, false>();
    } else {
      need.log_z ? run.template operator()<true, false, true>() : run.template operator()<true, false, false>();
    }
  } else if (need.counts) {
    need.log_z ? run.template operator()<false, true, true>() : run.template operator()<false, true, false>();
  } else {
    run.template operator()<false, false, true>();
  }
  __syncthreads();
  u64* mass = ws.mass + static_cast<int64_t>(r) * kBins;
  unsigned* count = ws.count + static_cast<int64_t>(r) * kBins;
  for (int b = threadIdx.x; b < kBins; b += kChunkThreads) {
    const u64 m = (static_cast<u64>(sh.mass_hi[b]) << 32) + sh.mass_lo[b];
    if (m != 0) atomicAdd(&mass[b], m);
    if (sh.count[b] != 0) atomicAdd(&count[b], sh.count[b]);
  }
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
// the row's plan to that window's list (in no particular order). Which windows hold a bin is a byte per bin in shared
// memory, so a logit outside every window costs its bin and one shared load (the windows' hull, tested before, could
// span most of the row when the top-p and pick windows lay far apart: then every warp took the per-window path).
__global__ void __launch_bounds__(kChunkThreads) row_gather_kernel(int vocab, int chunk_len, const RowSampling* rows,
                                                                   const float* logits, Workspace ws) {
  __shared__ ReduceScratch rs;
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
  const RowInfo info = row_info(ws.stats + static_cast<int64_t>(r) * ws.blocks, gridDim.x, rs);  // synchronises
  const Binning bn = make_binning(info.max_logit, info.min_logit, rsamp.params.temperature);
  const float* row = logits + static_cast<int64_t>(rsamp.row) * vocab;
  u64* lists = ws.lists + static_cast<int64_t>(r) * kWindows * kGather;
  const bool vec = vector_row(row);
  const int begin = c * chunk_len, end = min(vocab, begin + chunk_len);
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += 4 * kChunkThreads) {
    const int at = base + static_cast<int>(threadIdx.x) * 4;
    const float4 v = load4(row, at, end, vec);
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
  load_exp2(sh.exp2);
  __syncthreads();
  const float* row_logits = logits + static_cast<int64_t>(rs.row) * vocab;
  const RowCtx row{row_logits,
                   vocab,
                   make_binning(info.max_logit, info.min_logit, rs.params.temperature),
                   static_cast<double>(info.max_logit),
                   1.0 / static_cast<double>(rs.params.temperature),
                   vector_row(row_logits),
                   &sh.plan,
                   ws.lists + r * kWindows * kGather,
                   sh.exp2};
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

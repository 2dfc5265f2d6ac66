// The cuts of one row, resolved by one CTA (sampling_cuda.cu's row_pick; design in docs/PERF.md, "Sampling"): the
// bin holding a target from the histogram's prefix sums (the mass; counts from count_pass when needed), that bin's
// candidates (from a window's list or a pass over the row), a rank or bitonic sort and scan in shared memory or a radix
// descent for a bin too large for it, and the sampled id of a row through its top-k, top-p and pick cuts (a top-k row
// from its sorted window in one scan). Device code in an anonymous namespace: included only by sampling_cuda.cu.
#pragma once

#include "ops/elementwise/cuda_utils.cuh"
#include "ops/sampling/sampling_rows.cuh"

namespace bg::ops {
namespace {

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
  Exp2Entry exp2[kExp2Steps];  // load_exp2's copy for mass_of
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
  double inv_temperature;  // of the mass weights: mass_inv_temperature (1 / T; 1 for a greedy row)
  bool vec;                // 16-byte loads of the row are aligned
  const RowPlan* plan;     // row_gather's windows (shared memory copy)
  const u64* lists;        // and their candidates: [kWindows][kGather] (global)
  const Exp2Entry* exp2;   // mass_of's table (shared memory)
};

template <Weigh kW>
__device__ __forceinline__ u64 weight_of(const RowCtx& row, float l) {
  if constexpr (kW == Weigh::kMass) {
    return mass_of(l, row.max_logit, row.inv_temperature, row.exp2);
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

// Exclusive prefix of a histogram (kBins entries) into shared excl[0..kBins], by a block of kThreads (hist may be excl:
// each thread reads its bins before the scan and writes them after).
template <typename T, int kThreads = kPickThreads>
__device__ void scan_histogram(const T* hist, T* excl, u64* scratch) {
  constexpr int kPer = kBins / kThreads;
  static_assert(kBins % kThreads == 0);
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
__device__ __noinline__ int gather(const RowCtx& row, const BinPred& p, PickShared& sh) {
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

static_assert(kPickThreads % 32 == 0);

// Sorts sh.keys[0..n) descending (n <= kGather), padding with 0 up to the next power of two; returns that size. Up to
// kRankSortMax keys (a bin's candidates, a top-k window), each key's place is the number of larger keys (keys are
// distinct): one pass of broadcast shared loads and two barriers, against a bitonic network's dozens of steps.
constexpr int kRankSortMax = 256;
static_assert(kRankSortMax <= kPickThreads);

__device__ __forceinline__ int sort_keys(int n, PickShared& sh) {
  int size = 1;
  while (size < n) size <<= 1;
  if (n <= kRankSortMax) {
    __syncthreads();  // the keys were written by every warp
    const int t = static_cast<int>(threadIdx.x);
    u64 key = 0;
    int place = t;
    if (t < n) {
      key = sh.keys[t];
      place = 0;
      for (int j = 0; j < n; ++j) place += sh.keys[j] > key ? 1 : 0;
    }
    __syncthreads();
    if (t < size) sh.keys[place] = key;  // keys at their places, zeros after them
    __syncthreads();
    return size;
  }
  for (int i = n + static_cast<int>(threadIdx.x); i < size; i += kPickThreads) sh.keys[i] = 0;
  // A step with j < 32 exchanges keys within a 32-aligned run of indices, and one warp owns each run (thread t handles
  // t, t + kPickThreads, ...): such steps need only __syncwarp between them; a step reaching across warps (j >= 32) has
  // a __syncthreads on either side.
  bool wide = true;  // the keys and the padding were written by every warp
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (wide || j >= 32) {
        __syncthreads();
      } else {
        __syncwarp();
      }
      wide = j >= 32;
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
    }
  }
  __syncthreads();
  return size;
}

// Among the sorted keys sh.keys[0..size) (zeros last), the first at which the running selection weight exceeds target:
// sets sh.found_key / found_run (in-bin, inclusive) and, when kAlsoMass, found_mass (in-bin mass through it).
template <Weigh kW, bool kAlsoMass>
__device__ __noinline__ void scan_sorted(const RowCtx& row, int size, u64 target, PickShared& sh) {
  constexpr int kPer = kGather / kPickThreads;
  const int first = static_cast<int>(threadIdx.x) * kPer;
  u64 w[kPer], m[kPer];
  u64 sum = 0, msum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = first + k;
    const u64 key = i < size ? sh.keys[i] : 0;
    w[k] = key != 0 ? weight_of<kW>(row, key_logit(key)) : 0;
    m[k] = kAlsoMass && key != 0 ? mass_of(key_logit(key), row.max_logit, row.inv_temperature, row.exp2) : 0;
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
__device__ __noinline__ void pred_sums(const RowCtx& row, const BinPred& p, u64 at_least, PickShared& sh, u64* weight,
                                       u64* mass) {
  u64 w = 0, m = 0;
  for (int i = threadIdx.x; i < row.vocab; i += kPickThreads) {
    const float l = row.logits[i];
    u64 key = 0;
    if (!in_bin(row, p, l, i, &key) || key < at_least) continue;
    w += weight_of<kW>(row, l);
    if constexpr (kAlsoMass) m += mass_of(l, row.max_logit, row.inv_temperature, row.exp2);
  }
  *weight = cuda_util::block_reduce(w, cuda_util::SumOp{}, u64{0}, sh.rs.u64s);
  *mass = cuda_util::block_reduce(m, cuda_util::SumOp{}, u64{0}, sh.rs.u64s);
}

// The fallback for a bin with more than kGather candidates: a radix descent over the logit bits (four 8-bit histogram
// passes over the row restricted to the bin), then an index-ordered scan among the equal logits left. Returns the key
// of the first candidate (descending key order) at which the running weight exceeds target.
template <Weigh kW>
__device__ __noinline__ u64 radix_select(const RowCtx& row, const BinPred& p, u64 target, PickShared& sh) {
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
__device__ __noinline__ Cut cut(const RowCtx& row, const T* excl, u64 target, u64 lo, int lo_bin, PickShared& sh) {
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

// The exact count histogram of the row as an exclusive prefix in sh.count_excl (one pass over the row by the CTA): the
// fallback when a window of row_plan (bounded from the mass) did not gather the logits it was meant to.
__device__ __noinline__ void count_pass(const RowCtx& row, PickShared& sh) {
  for (int b = threadIdx.x; b < kBins; b += kPickThreads) sh.count_excl[b] = 0;
  __syncthreads();
  for (int base = 0; base < row.vocab; base += 4 * kPickThreads) {
    const int at = base + static_cast<int>(threadIdx.x) * 4;
    const float4 v = load4(row.logits, at, row.vocab, row.vec);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (at + k < row.vocab) atomicAdd(&sh.count_excl[bin_of(row.bn, lane_of(v, k))], 1u);
    }
  }
  __syncthreads();
  scan_histogram(sh.count_excl, sh.count_excl, sh.scan_u64);  // in place
}

// The number of logits row_gather collected for window w when it starts at bin 0 and all of them fit (then they are
// every logit of bins 0 .. hi, so the m best keys of the row are the list's m best when it holds at least m); else -1.
__device__ __forceinline__ int top_list_size(const RowPlan& plan, int w) {
  if (plan.lo[w] != 0 || plan.hi[w] < 0 || plan.n[w] > static_cast<unsigned>(kGather)) return -1;
  return static_cast<int>(plan.n[w]);
}

// Copies window w's list (n keys) into sh.keys and sorts it, best first; returns the padded size (sort_keys).
__device__ __forceinline__ int sorted_list(const RowCtx& row, int w, int n, PickShared& sh) {
  const u64* list = row.lists + w * kGather;
  for (int i = threadIdx.x; i < n; i += kPickThreads) sh.keys[i] = list[i];
  return sort_keys(n, sh);  // synchronises first
}

// The n best keys of the row, best first, into sh.top_keys: the first n of row_gather's sorted best window when it
// holds them; else a count cut over the whole row (exact counts from count_pass) and the keys at or above it.
__device__ __noinline__ void best_keys(const RowCtx& row, int n, PickShared& sh) {
  const RowPlan& plan = *row.plan;
  if (const int listed = top_list_size(plan, kWinBest); listed >= n) {
    sorted_list(row, kWinBest, listed, sh);
    if (static_cast<int>(threadIdx.x) < n) sh.top_keys[threadIdx.x] = sh.keys[threadIdx.x];
    __syncthreads();
    return;
  }
  count_pass(row, sh);
  const Cut c = cut<Weigh::kCount, false>(row, sh.count_excl, static_cast<u64>(n - 1), 0, kBins - 1, sh);
  if (threadIdx.x == 0) sh.n_top_found = 0;
  __syncthreads();
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
  // Best first: each key's place is the number of larger keys (keys are distinct).
  const int found = min(sh.n_top_found, kMaxTopLogprobs);
  u64 key = 0;
  int place = 0;
  if (static_cast<int>(threadIdx.x) < found) {
    key = sh.top_keys[threadIdx.x];
    for (int b = 0; b < found; ++b) place += sh.top_keys[b] > key ? 1 : 0;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < found) sh.top_keys[place] = key;
  __syncthreads();
}

// Smallest prefix with mass / total >= top_p: the first key at which the running mass exceeds ceil(top_p * kept) - 1.
// Then the pick, as on the CPU: the first id whose running mass exceeds u * kept. Both targets are monotone in the kept
// mass, so bounds on the kept mass give bounds on the targets (row_plan).
__device__ __forceinline__ u64 top_p_target(float top_p, u64 kept) {
  const u64 need = static_cast<u64>(ceil(static_cast<double>(top_p) * static_cast<double>(kept)));
  return min(max(need, u64{1}), kept) - 1;
}
__device__ __forceinline__ u64 pick_target(double u, u64 kept) {
  return min(static_cast<u64>(u * static_cast<double>(kept)), kept - 1);
}

// A top-k row whose k best row_gather collected (every logit of bins 0 .. B, sorted here): the three cuts in one scan
// of the sorted list, with the arithmetic of the bin-wise cuts (the same weights and targets, so the same id): the kept
// mass is that of the k best; the top-p cut is the first key at which the running mass exceeds its target, and the mass
// through it is kept; the pick is the first key at which the running mass exceeds u times that.
__device__ __forceinline__ u64 sample_top_k_list(const RowSampling& rs, const RowCtx& row, int listed, PickShared& sh) {
  const SamplingParams& sp = rs.params;
  sorted_list(row, kWinTopK, listed, sh);
  const int keep = static_cast<int>(sp.top_k);  // <= listed
  constexpr int kPer = kGather / kPickThreads;
  const int first = static_cast<int>(threadIdx.x) * kPer;
  u64 m[kPer];
  u64 sum = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    m[k] = first + k < keep ? mass_of(key_logit(sh.keys[first + k]), row.max_logit, row.inv_temperature, row.exp2) : 0;
    sum += m[k];
  }
  if (threadIdx.x == 0) {
    sh.found = -1;
    sh.found_run = 0;
  }
  u64 kept = 0;
  const u64 before = block_exclusive_scan(sum, sh.scan_u64, &kept);  // synchronises: the found fields are reset
  if (sp.top_p < 1.0f) {
    const u64 target = top_p_target(sp.top_p, kept);
    u64 run = before;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if (m[k] > 0 && run <= target && target < run + m[k]) sh.found_run = run + m[k];
      run += m[k];
    }
    __syncthreads();
    kept = sh.found_run;
    if (kept == 0) return 0;  // every thread: the cut was not found
  }
  const u64 target = pick_target(rs.uniform, kept);
  u64 run = before;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (m[k] > 0 && run <= target && target < run + m[k]) sh.found = first + k;
    run += m[k];
  }
  __syncthreads();
  const int found = sh.found;
  const u64 key = found < 0 ? 0 : sh.keys[found];
  __syncthreads();
  return key;
}

// The key of the sampled id of a sampling row (all threads return it); 0 if a cut was not found. A top-k row takes the
// list path when row_gather collected its k best, else exact counts (count_pass) and the bin-wise cuts.
__device__ __forceinline__ u64 sample_row(const RowSampling& rs, const RowCtx& row, const int64_t r,
                                          const Workspace& ws, PickShared& sh) {
  const SamplingParams& sp = rs.params;
  const bool top_k = sp.top_k > 0 && sp.top_k < row.vocab;
  if (top_k) {
    if (const int listed = top_list_size(*row.plan, kWinTopK); listed >= sp.top_k) {
      return sample_top_k_list(rs, row, listed, sh);
    }
  }
  scan_histogram(ws.mass + r * kBins, sh.mass_excl, sh.scan_u64);
  u64 kept = sh.mass_excl[kBins];
  u64 lo = 0;
  int lo_bin = kBins - 1;
  if (top_k) {
    count_pass(row, sh);
    const Cut c = cut<Weigh::kCount, true>(row, sh.count_excl, static_cast<u64>(sp.top_k - 1), 0, kBins - 1, sh);
    if (c.key == 0) return 0;
    lo = c.key;
    lo_bin = c.bin;
    kept = sh.mass_excl[c.bin] + c.mass;
  }
  if (sp.top_p < 1.0f) {
    const Cut c = cut<Weigh::kMass, false>(row, sh.mass_excl, top_p_target(sp.top_p, kept), lo, lo_bin, sh);
    if (c.key == 0) return 0;
    lo = c.key;
    lo_bin = c.bin;
    kept = c.run;
  }
  const Cut c = cut<Weigh::kMass, false>(row, sh.mass_excl, pick_target(rs.uniform, kept), lo, lo_bin, sh);
  return c.key;
}

}  // namespace
}  // namespace bg::ops

// CUDA sampling: one block per row, no workspace and no sort. Each logit gets a 64-bit key (order-preserving logit
// bits, then the inverted index) so that descending key order is exactly the CPU's order (logit descending, lower
// index first; -0 and +0 tie). Every cut is a "weighted select": the first key in descending order at which the
// running weight (a count for top-k, the fixed-point probability mass for top-p and the pick) exceeds a target, found
// by a radix descent over the logit bits (four 8-bit histogram passes) and an index-ordered scan among equal logits.
// The step kernel (sample_rows_cuda) adds the finite flag, and the logprobs as a count select of the n best keys.
#include "ops/sampling/sampling_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using u64 = unsigned long long;

constexpr int kThreads = 512;
constexpr double kMassScale = 17592186044416.0;  // 2^44: a probability p in [0, 1] weighs rint(p * 2^44)
// Fixed-point mass: at most kSamplingMaxVocab (2^19) * 2^44 = 2^63 in total, so u64 sums never overflow.

struct Shared {
  u64 hist[256];
  u64 reduce_u64[32];
  double reduce_f64[32];
  u64 top_keys[kMaxTopLogprobs];
  int n_top_found;
  int reduce_int[32];
  u64 above;
  unsigned chosen;
  int found;
};

// Order-preserving bits: a > b as floats <=> ordered(a) > ordered(b); -0 maps like +0 (they tie on the CPU).
__device__ __forceinline__ unsigned ordered(float f) {
  const unsigned b = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_ordered(unsigned o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
// Larger key = earlier in the CPU's sorted order.
__device__ __forceinline__ u64 make_key(unsigned ord, int i) {
  return (static_cast<u64>(ord) << 32) | (0xffffffffu - static_cast<unsigned>(i));
}
__device__ __forceinline__ int key_index(u64 key) {
  return static_cast<int>(0xffffffffu - static_cast<unsigned>(key & 0xffffffffu));
}

struct Row {
  const float* logits;  // [vocab]
  int vocab;
  double max_logit;
  double temperature;
};

// kMass: fixed-point exp((l - max) / T), the CPU's double formula; else 1 (counting for top-k).
template <bool kMass>
__device__ __forceinline__ u64 weight(const Row& row, float l) {
  if constexpr (kMass) {
    return __double2ull_rn(exp((static_cast<double>(l) - row.max_logit) / row.temperature) * kMassScale);
  } else {
    return 1;
  }
}

// Exclusive prefix sum of one int per thread, in thread order.
__device__ int block_exclusive_scan(int v, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  int incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  __syncthreads();
  if (lane == 31) sh.reduce_int[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int s = lane < n_warps ? sh.reduce_int[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += n;
    }
    sh.reduce_int[lane] = s;  // inclusive totals per warp
  }
  __syncthreads();
  return (warp > 0 ? sh.reduce_int[warp - 1] : 0) + incl - v;
}

// Total weight of the candidates (key >= lo).
template <bool kMass>
__device__ u64 weight_sum(const Row& row, u64 lo, Shared& sh) {
  u64 sum = 0;
  for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) {
    const float l = row.logits[i];
    if (make_key(ordered(l), i) >= lo) sum += weight<kMass>(row, l);
  }
  return cuda_util::block_reduce(sum, cuda_util::SumOp{}, u64{0}, sh.reduce_u64);
}

// Among the candidates (key >= lo) in descending key order, the key of the first one at which the running weight
// exceeds target. Needs target < the candidates' total weight (then the answer exists and has weight > 0); returns
// 0 if that does not hold.
template <bool kMass>
__device__ u64 select_key(const Row& row, u64 lo, u64 target, Shared& sh) {
  unsigned prefix = 0, mask = 0;
  u64 above = 0;  // weight of the candidates ahead of the current prefix
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < row.vocab; i += blockDim.x) {
      const float l = row.logits[i];
      const unsigned o = ordered(l);
      if ((o & mask) != prefix || make_key(o, i) < lo) continue;
      atomicAdd(&sh.hist[(o >> shift) & 255u], weight<kMass>(row, l));  // integer: the order does not matter
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u64 run = above;
      int b = 255;
      for (; b > 0; --b) {  // all higher bins short of target: the crossing is in bin 0
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
  // The candidates left all have the logit of `prefix`, hence one weight w: the answer is the j-th of them in index
  // order. Each thread scans a contiguous index range; a prefix sum of the counts finds the range holding it.
  const u64 w = weight<kMass>(row, from_ordered(prefix));
  const u64 j = w > 0 ? (target - above) / w : 0;
  const int chunk = (row.vocab + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int begin = static_cast<int>(threadIdx.x) * chunk;
  const int end = min(row.vocab, begin + chunk);
  int count = 0;
  for (int i = begin; i < end; ++i) count += ordered(row.logits[i]) == prefix && make_key(prefix, i) >= lo;
  if (threadIdx.x == 0) sh.found = -1;
  const int first = block_exclusive_scan(count, sh);  // synchronises, so sh.found = -1 is visible
  if (j >= static_cast<u64>(first) && j < static_cast<u64>(first + count)) {
    int skip = static_cast<int>(j - static_cast<u64>(first));
    for (int i = begin; i < end; ++i) {
      if (ordered(row.logits[i]) != prefix || make_key(prefix, i) < lo) continue;
      if (skip-- == 0) {
        sh.found = i;
        break;
      }
    }
  }
  __syncthreads();
  const int found = sh.found;
  __syncthreads();  // sh.found is rewritten by the next call
  return found < 0 ? 0 : make_key(prefix, found);
}

// The sampled id of one row (all threads return it), given its largest key. -1 for parameters the CPU rejects.
__device__ int sample_row(const SamplingParams& sp, double u, const float* logits, int vocab, u64 best, Shared& sh) {
  if (!(sp.top_p > 0.0f && sp.top_p <= 1.0f) || sp.top_k < 0 || !(u >= 0.0 && u < 1.0)) return -1;
  const float max_logit = from_ordered(static_cast<unsigned>(best >> 32));
  if (isinf(max_logit)) return -1;
  const Row row{logits, vocab, static_cast<double>(max_logit), static_cast<double>(sp.temperature)};
  u64 lo = 0;  // candidates: key >= lo (every key is > 0)
  if (sp.top_k > 0 && sp.top_k < vocab) {
    lo = select_key<false>(row, 0, static_cast<u64>(sp.top_k - 1), sh);
    if (lo == 0) return -1;  // cannot happen (exact integer counts); never sample from a wrong set
  }
  u64 kept = weight_sum<true>(row, lo, sh);
  if (sp.top_p < 1.0f) {
    // Smallest prefix with mass / total >= top_p: the first at which the running mass exceeds ceil(top_p * total) - 1.
    const u64 need = static_cast<u64>(ceil(static_cast<double>(sp.top_p) * static_cast<double>(kept)));
    lo = select_key<true>(row, lo, min(max(need, u64{1}), kept) - 1, sh);
    if (lo == 0) return -1;
    kept = weight_sum<true>(row, lo, sh);
  }
  // The CPU returns the first id whose running mass exceeds u * kept.
  const u64 target = min(static_cast<u64>(u * static_cast<double>(kept)), kept - 1);
  const u64 key = select_key<true>(row, lo, target, sh);
  return key == 0 ? -1 : key_index(key);
}

// grid (n_rows), block kThreads. params == nullptr: every row greedy.
__global__ void __launch_bounds__(kThreads) sample_kernel(SamplingBatch b, const SamplingParams* params,
                                                          const float* logits, const double* uniforms, int32_t* ids) {
  __shared__ Shared sh;
  const int64_t r = blockIdx.x;
  const int vocab = static_cast<int>(b.vocab);
  const float* row = logits + r * b.vocab;
  // The largest key is the argmax with ties to the lower index.
  u64 best = 0;
  int has_nan = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float l = row[i];
    if (isnan(l)) {
      has_nan = 1;
    } else {
      best = max(best, make_key(ordered(l), i));
    }
  }
  best = cuda_util::block_reduce(best, cuda_util::MaxOp{}, u64{0}, sh.reduce_u64);
  has_nan = cuda_util::block_reduce(has_nan, cuda_util::MaxOp{}, 0, sh.reduce_int);
  int id = -1;
  if (!has_nan) {
    const SamplingParams sp = params != nullptr ? params[r] : SamplingParams{};
    id = sp.temperature <= 0.0f ? key_index(best) : sample_row(sp, uniforms[r], row, vocab, best, sh);
  }
  if (threadIdx.x == 0) ids[r] = id;
}

// The log-softmax of a finite row (double, as top_logprobs_cpu) at `token` and at its n_top best keys, written to *o
// by thread 0. The n_top best are the keys >= the n_top-th largest (a count select), sorted by thread 0.
__device__ void row_logprobs(const float* logits, int vocab, u64 best, int token, int n_top, Shared& sh,
                             RowSample* o) {
  const double max_logit = static_cast<double>(from_ordered(static_cast<unsigned>(best >> 32)));
  double sum = 0.0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += exp(static_cast<double>(logits[i]) - max_logit);
  sum = cuda_util::block_reduce(sum, cuda_util::SumOp{}, 0.0, sh.reduce_f64);
  const double log_z = max_logit + log(sum);
  const int n = min(n_top, vocab);
  if (n > 0) {
    const Row counting{logits, vocab, 0.0, 1.0};
    const u64 lo = select_key<false>(counting, 0, static_cast<u64>(n - 1), sh);  // exactly n keys are >= lo
    if (threadIdx.x == 0) sh.n_top_found = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const u64 key = make_key(ordered(logits[i]), i);
      if (key < lo) continue;
      const int slot = atomicAdd(&sh.n_top_found, 1);
      if (slot < kMaxTopLogprobs) sh.top_keys[slot] = key;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  for (int a = 1; a < n; ++a) {  // insertion sort, largest key (best) first
    const u64 key = sh.top_keys[a];
    int b = a;
    for (; b > 0 && sh.top_keys[b - 1] < key; --b) sh.top_keys[b] = sh.top_keys[b - 1];
    sh.top_keys[b] = key;
  }
  for (int a = 0; a < n; ++a) {
    const int id = key_index(sh.top_keys[a]);
    o->top_ids[a] = id;
    o->top_logprobs[a] = static_cast<float>(static_cast<double>(logits[id]) - log_z);
  }
  o->n_top = n;
  o->logprob = static_cast<float>(static_cast<double>(logits[token]) - log_z);
}

// One step's rows: grid (n_rows), block kThreads; block b samples rows[b] into out[b].
__global__ void __launch_bounds__(kThreads) sample_rows_kernel(int vocab, const RowSampling* rows, const float* logits,
                                                               RowSample* out) {
  __shared__ Shared sh;
  const RowSampling rs = rows[blockIdx.x];
  const float* row = logits + static_cast<int64_t>(rs.row) * vocab;
  RowSample* o = out + blockIdx.x;
  u64 best = 0;
  int non_finite = 0;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float l = row[i];
    if (isfinite(l)) {
      best = max(best, make_key(ordered(l), i));
    } else {
      non_finite = 1;
    }
  }
  best = cuda_util::block_reduce(best, cuda_util::MaxOp{}, u64{0}, sh.reduce_u64);
  non_finite = cuda_util::block_reduce(non_finite, cuda_util::MaxOp{}, 0, sh.reduce_int);
  if (non_finite) {  // the engine fails this request: no id, no logprobs
    if (threadIdx.x == 0) {
      o->token = -1;
      o->finite = false;
      o->n_top = 0;
      o->logprob = 0.0f;
    }
    return;
  }
  const int token = rs.params.temperature <= 0.0f ? key_index(best)
                                                  : sample_row(rs.params, rs.uniform, row, vocab, best, sh);
  if (threadIdx.x == 0) {
    o->token = token;
    o->finite = true;
    o->n_top = 0;
    o->logprob = 0.0f;
  }
  if (rs.n_top >= 0 && token >= 0) row_logprobs(row, vocab, best, token, rs.n_top, sh, o);
}

void check_batch(const SamplingBatch& b, const char* who) {
  BG_CHECK(b.n_rows >= 0 && b.n_rows < (int64_t{1} << 31), "{}: bad n_rows {}", who, b.n_rows);
  BG_CHECK(b.vocab > 0 && b.vocab <= kSamplingMaxVocab, "{}: vocab {} outside [1, {}]", who, b.vocab,
           kSamplingMaxVocab);
}

}  // namespace

void sample_rows_cuda(const SamplingBatch& b, const RowSampling* rows, const float* logits, RowSample* out,
                      cudaStream_t stream) {
  check_batch(b, "sample_rows_cuda");
  if (b.n_rows == 0) return;
  BG_CHECK(rows && logits && out, "sample_rows_cuda: null pointer with n_rows {}", b.n_rows);
  sample_rows_kernel<<<static_cast<unsigned>(b.n_rows), kThreads, 0, stream>>>(static_cast<int>(b.vocab), rows,
                                                                                logits, out);
  BG_CUDA_CHECK_LAUNCH();
}

void argmax_cuda(const SamplingBatch& b, const float* logits, int32_t* ids, cudaStream_t stream) {
  check_batch(b, "argmax_cuda");
  if (b.n_rows == 0) return;
  BG_CHECK(logits && ids, "argmax_cuda: null pointer with n_rows {}", b.n_rows);
  sample_kernel<<<static_cast<unsigned>(b.n_rows), kThreads, 0, stream>>>(b, nullptr, logits, nullptr, ids);
  BG_CUDA_CHECK_LAUNCH();
}

void sample_cuda(const SamplingBatch& b, const SamplingParams* params, const float* logits, const double* uniforms,
                 int32_t* ids, cudaStream_t stream) {
  check_batch(b, "sample_cuda");
  if (b.n_rows == 0) return;
  BG_CHECK(params && logits && uniforms && ids, "sample_cuda: null pointer with n_rows {}", b.n_rows);
  sample_kernel<<<static_cast<unsigned>(b.n_rows), kThreads, 0, stream>>>(b, params, logits, uniforms, ids);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

// MLA decode launcher: absorb GEMM (cuBLAS) -> prep kernel (split-KV schedule + q_pe copy) -> attention kernel
// (mla_decode_attention.cu) -> log-sum-exp combine of split tokens -> W_UV GEMM (cuBLAS). All on one stream.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_decode_internal.h"

namespace bg::ops {
namespace {

using bf16 = __nv_bfloat16;
using mla_decode::AttentionArgs;

constexpr int kPrepThreads = 1024;
constexpr int kCombineThreads = 256;
constexpr int64_t kCopyCtas = 132;  // q_pe copy CTAs (grid-stride)
constexpr int64_t kMaxPosition = int64_t{1} << 28;  // keeps every tile count and prefix inside int32
constexpr float kLog2e = 1.4426950408889634f;

struct PrepArgs {
  const bf16* q;   // [n, H, nope + 64]
  bf16* q_full;    // [n, H, 576]
  int32_t* meta;   // MlaDecodeMeta
  MlaPagedCache cache;
  int n_tokens, n_heads, nope, qk, block_size;
  int n_partitions, min_tiles;
  bool per_token;  // MlaDecodePlan::per_token: partition t is token t, nothing split
  bool align;      // MlaDecodePlan::align_tokens: the token-aligned schedule where it pays
};

// Exclusive prefix sum over the CTA (blockDim.x = kPrepThreads); *total receives the CTA's sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  return cuda_util::block_exclusive_scan<kPrepThreads>(v, warp_sums, total);
}

// Raises an error bit for the backend to report after the step (cache.error_flags), or traps when there is no flag
// word. Only the prep kernel may trap: in the attention kernel it would serialise every wgmma.
__device__ void raise_error(const MlaPagedCache& c, int32_t bit) {
  if (c.error_flags == nullptr) __trap();
  atomicOr(c.error_flags, bit);
}

__device__ bool bad_position(const PrepArgs& a, int64_t pos) {
  return pos < 0 || pos >= kMaxPosition || pos / a.block_size >= a.cache.max_blocks_per_seq;
}

// Token t's tiles [lo, hi) of the concatenation (prefix written by this CTA before a barrier).
__device__ __forceinline__ void token_tiles(const int32_t* prefix, int n_tokens, int64_t total, int t, int64_t& lo,
                                            int64_t& hi) {
  lo = prefix[t];
  hi = t + 1 < n_tokens ? prefix[t + 1] : total;
}

// The token-aligned schedule (mla_decode_plan.h; host model: aligned_schedule in mla_decode_plan.cpp) into meta when
// mla_aligned_schedule_pays; false, with only partition_begin written (the even schedule rewrites it), otherwise.
// Every thread of CTA 0 calls it with prefix[] written and visible (after a barrier).
__device__ bool write_aligned_schedule(const PrepArgs& a, int64_t total, int64_t n_used) {
  __shared__ int n_split_even, max_aligned;
  if (threadIdx.x == 0) n_split_even = max_aligned = 0;
  __syncthreads();
  const int32_t* prefix = a.meta + MlaDecodeMeta::kTilePrefix;
  int32_t* part_begin = a.meta + MlaDecodeMeta::partition_begin(a.n_tokens);
  // Partition g begins at the first token whose home is g or later: token t writes the begins of the partitions
  // after its predecessor's home up to its own; the last token those after its home (the total).
  for (int t = static_cast<int>(threadIdx.x); t < a.n_tokens; t += kPrepThreads) {
    int64_t lo = 0, hi = 0;
    token_tiles(prefix, a.n_tokens, total, t, lo, hi);
    if (mla_partition_of(hi - 1, total, n_used) > mla_partition_of(lo, total, n_used)) atomicAdd(&n_split_even, 1);
    const int64_t home = mla_home_partition(lo, hi, total, n_used);
    int64_t prev_home = -1;
    if (t > 0) {
      int64_t plo = 0, phi = 0;
      token_tiles(prefix, a.n_tokens, total, t - 1, plo, phi);
      prev_home = mla_home_partition(plo, phi, total, n_used);
    }
    for (int64_t g = prev_home + 1; g <= home; ++g) part_begin[g] = static_cast<int32_t>(lo);
    if (t + 1 == a.n_tokens) {
      for (int64_t g = home + 1; g <= a.n_partitions; ++g) part_begin[g] = static_cast<int32_t>(total);
    }
  }
  __syncthreads();  // every begin written (global memory, this CTA)
  for (int g = static_cast<int>(threadIdx.x); g < n_used; g += kPrepThreads) {
    atomicMax(&max_aligned, part_begin[g + 1] - part_begin[g]);
  }
  __syncthreads();
  if (!mla_aligned_schedule_pays(max_aligned, total, n_used, n_split_even)) return false;
  for (int t = static_cast<int>(threadIdx.x); t < a.n_tokens; t += kPrepThreads) {
    int64_t lo = 0, hi = 0;
    token_tiles(prefix, a.n_tokens, total, t, lo, hi);
    a.meta[MlaDecodeMeta::n_splits(a.n_tokens) + t] = 1;
    a.meta[MlaDecodeMeta::slot_base(a.n_tokens) + t] = 0;
    a.meta[MlaDecodeMeta::first_partition(a.n_tokens) + t] =
        static_cast<int32_t>(mla_home_partition(lo, hi, total, n_used));
  }
  return true;
}

// CTA 0: the split-KV schedule into meta (two scans over the tokens, in chunks of kPrepThreads). A position outside
// its sequence's block table (a step laid out wrong: reading on would touch other sequences) raises
// kMlaErrorBadPosition and leaves a schedule with no partition, so the attention kernel reads nothing.
__device__ void write_schedule(const PrepArgs& a) {
  __shared__ int warp_sums[32];
  __shared__ int any_bad;
  if (threadIdx.x == 0) any_bad = 0;
  __syncthreads();
  int32_t* prefix = a.meta + MlaDecodeMeta::kTilePrefix;
  int carry = 0, chunk_total = 0;
  for (int first = 0; first < a.n_tokens; first += kPrepThreads) {
    const int t = first + static_cast<int>(threadIdx.x);
    int tiles = 0;
    if (t < a.n_tokens) {
      const int64_t pos = a.cache.positions[t];
      if (bad_position(a, pos)) any_bad = 1;
      tiles = bad_position(a, pos) ? 1 : static_cast<int>(mla_tiles_of_context(pos + 1));
    }
    const int excl = block_exclusive_scan(tiles, warp_sums, &chunk_total);
    if (t < a.n_tokens) prefix[t] = carry + excl;
    carry += chunk_total;
  }
  const int64_t total = carry;
  __syncthreads();  // prefix[] of every token is written (global memory, same CTA), any_bad is final
  if (any_bad != 0) {
    for (int t = static_cast<int>(threadIdx.x); t < a.n_tokens; t += kPrepThreads) {
      a.meta[MlaDecodeMeta::n_splits(a.n_tokens) + t] = 1;
      a.meta[MlaDecodeMeta::slot_base(a.n_tokens) + t] = 0;
      a.meta[MlaDecodeMeta::first_partition(a.n_tokens) + t] = 0;
    }
    for (int g = static_cast<int>(threadIdx.x); g <= a.n_partitions; g += kPrepThreads) {
      a.meta[MlaDecodeMeta::partition_begin(a.n_tokens) + g] = 0;
    }
    if (threadIdx.x == 0) {
      prefix[a.n_tokens] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::kTotalTiles] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::kPartitionsUsed] = 0;
      raise_error(a.cache, kMlaErrorBadPosition);
    }
    return;
  }
  if (a.per_token) {
    for (int t = static_cast<int>(threadIdx.x); t < a.n_tokens; t += kPrepThreads) {
      a.meta[MlaDecodeMeta::n_splits(a.n_tokens) + t] = 1;
      a.meta[MlaDecodeMeta::slot_base(a.n_tokens) + t] = 0;
      a.meta[MlaDecodeMeta::first_partition(a.n_tokens) + t] = t;
      a.meta[MlaDecodeMeta::partition_begin(a.n_tokens) + t] = prefix[t];
    }
    if (threadIdx.x == 0) {
      prefix[a.n_tokens] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::partition_begin(a.n_tokens) + a.n_tokens] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::kTotalTiles] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::kPartitionsUsed] = a.n_tokens;
    }
    return;
  }
  const int64_t n_used = mla_partitions_used(total, a.n_partitions, a.min_tiles);
  if (a.align && write_aligned_schedule(a, total, n_used)) {
    if (threadIdx.x == 0) {
      prefix[a.n_tokens] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::kTotalTiles] = static_cast<int32_t>(total);
      a.meta[MlaDecodeMeta::kPartitionsUsed] = static_cast<int32_t>(n_used);
    }
    return;
  }
  __syncthreads();  // the aligned attempt's reads of partition_begin are done before the even schedule rewrites it
  carry = 0;
  for (int first = 0; first < a.n_tokens; first += kPrepThreads) {
    const int t = first + static_cast<int>(threadIdx.x);
    int n_splits = 0;
    int64_t first_part = 0;
    if (t < a.n_tokens) {
      int64_t lo = 0, hi = 0;
      token_tiles(prefix, a.n_tokens, total, t, lo, hi);
      first_part = mla_partition_of(lo, total, n_used);
      n_splits = static_cast<int>(mla_partition_of(hi - 1, total, n_used) - first_part) + 1;
    }
    const int excl = block_exclusive_scan(n_splits > 1 ? n_splits : 0, warp_sums, &chunk_total);
    if (t < a.n_tokens) {
      a.meta[MlaDecodeMeta::n_splits(a.n_tokens) + t] = n_splits;
      a.meta[MlaDecodeMeta::slot_base(a.n_tokens) + t] = carry + excl;
      a.meta[MlaDecodeMeta::first_partition(a.n_tokens) + t] = static_cast<int32_t>(first_part);
    }
    carry += chunk_total;
  }
  int32_t* part_begin = a.meta + MlaDecodeMeta::partition_begin(a.n_tokens);
  for (int g = static_cast<int>(threadIdx.x); g <= a.n_partitions; g += kPrepThreads) {
    part_begin[g] = static_cast<int32_t>(g < n_used ? mla_partition_begin(g, total, n_used) : total);
  }
  if (threadIdx.x == 0) {
    prefix[a.n_tokens] = static_cast<int32_t>(total);
    a.meta[MlaDecodeMeta::kTotalTiles] = static_cast<int32_t>(total);
    a.meta[MlaDecodeMeta::kPartitionsUsed] = static_cast<int32_t>(n_used);
  }
}

// CTAs 1..: q_pe (the last 64 of each head's q) into columns 512..575 of q_full. kVec: 16-byte copies (q 16-byte
// aligned, nope and nope + 64 multiples of 8).
template <bool kVec>
__device__ void copy_q_pe(const PrepArgs& a) {
  const int64_t rows = static_cast<int64_t>(a.n_tokens) * a.n_heads;
  const int64_t stride = static_cast<int64_t>(gridDim.x - 1) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  if constexpr (kVec) {
    for (int64_t i = first; i < rows * 8; i += stride) {
      const int64_t row = i / 8, v = i % 8;
      *reinterpret_cast<uint4*>(a.q_full + row * 576 + 512 + 8 * v) =
          *reinterpret_cast<const uint4*>(a.q + row * a.qk + a.nope + 8 * v);
    }
  } else {
    for (int64_t i = first; i < rows * 64; i += stride) {
      const int64_t row = i / 64, r = i % 64;
      a.q_full[row * 576 + 512 + r] = a.q[row * a.qk + a.nope + r];
    }
  }
}

// CTAs 1..: every block-table entry the attention kernel will read must name a block (>= 0); a negative one (a step
// laid out wrong) raises kMlaErrorBadBlock (the attention kernel reads such rows as zero). Bad positions are CTA 0's.
__device__ void check_block_tables(const PrepArgs& a) {
  for (int64_t t = blockIdx.x - 1; t < a.n_tokens; t += gridDim.x - 1) {
    const int64_t pos = a.cache.positions[t];
    if (bad_position(a, pos)) continue;
    const int32_t* table = a.cache.block_tables + static_cast<int64_t>(a.cache.seq_idx[t]) * a.cache.max_blocks_per_seq;
    for (int64_t b = threadIdx.x; b <= pos / a.block_size; b += blockDim.x) {
      if (table[b] < 0) raise_error(a.cache, kMlaErrorBadBlock);
    }
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kPrepThreads) prep_kernel(const PrepArgs a) {
  if (blockIdx.x == 0) {
    write_schedule(a);
  } else {
    copy_q_pe<kVec>(a);
    check_block_tables(a);
  }
}

struct CombineArgs {
  const float* part_o;   // [slots, n_groups, 512, Hc]
  const float* part_ml;  // [slots, n_groups, 2, Hc]
  const int32_t* meta;
  bf16* o_lat;  // [n, H, 512]
  int n_tokens, n_heads, n_groups, group_heads;
};

// grid (n_tokens, n_groups, 8 blocks of 64 channels): merges the partials of a split token in partition order
// (unsplit tokens exit; the attention kernel wrote them). Each CTA recomputes the token's weights (n_splits x Hc
// exp2) so that one token's merge spreads over 8 x n_groups CTAs. Shared memory: weights [n_splits, Hc] fp32, then a
// [Hc, 64] bf16 staging block for 16-byte stores. The loads are issued in parallel rounds: every split's maxima at
// once, then each thread's 4-head runs of 64 channels (float4 over the heads, the partials' fastest dimension; Hc is
// a multiple of 16) for all its runs of a split together; a token costs a few memory latencies, not one per
// element and split (the scalar version took 34 us at B = 64, 4k on the H100, now 19.5: bench/RESULTS.md 2026-12-06).
// Per element the same arithmetic in the same order: acc = fma(w_s, o_s, acc) over s ascending from 0.
constexpr int kCombineRuns = kMlaDecodeMaxGroupHeads * 64 / 4 / kCombineThreads;  // 4-head runs per thread
static_assert(kCombineRuns * kCombineThreads * 4 == kMlaDecodeMaxGroupHeads * 64, "whole runs per thread");
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const CombineArgs a) {
  const int64_t t = blockIdx.x;
  const int hg = static_cast<int>(blockIdx.y), cb = static_cast<int>(blockIdx.z), hc = a.group_heads;
  const int n_splits = a.meta[MlaDecodeMeta::n_splits(a.n_tokens) + t];
  if (n_splits <= 1) return;
  const int64_t slot0 = a.meta[MlaDecodeMeta::slot_base(a.n_tokens) + t];
  extern __shared__ float4 combine_smem[];
  float* weight = reinterpret_cast<float*>(combine_smem);
  bf16* stage = reinterpret_cast<bf16*>(weight + n_splits * hc);
  const float* __restrict__ part_ml = a.part_ml;
  const float* __restrict__ part_o = a.part_o;
  // The splits' maxima (log2 units) into weight[s, h], all at once.
  for (int e = threadIdx.x; e < n_splits * hc; e += blockDim.x) {
    const int s = e / hc, h = e - s * hc;
    weight[e] = part_ml[((slot0 + s) * a.n_groups + hg) * 2 * hc + h];
  }
  __syncthreads();
  for (int h = threadIdx.x; h < hc; h += blockDim.x) {
    float m = -INFINITY;
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, weight[s * hc + h]);
    float l = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
      l += exp2f(weight[s * hc + h] - m) * part_ml[((slot0 + s) * a.n_groups + hg) * 2 * hc + hc + h];
    }
    for (int s = 0; s < n_splits; ++s) weight[s * hc + h] = exp2f(weight[s * hc + h] - m) / l;
  }
  __syncthreads();
  // Run r = threadIdx.x + i * kCombineThreads (the block size): channel r / (hc / 4), heads 4 (r % (hc / 4)) + 0..3.
  const int runs_per_ch = hc / 4, n_runs = 64 * runs_per_ch;
  float4 acc[kCombineRuns];
#pragma unroll
  for (int i = 0; i < kCombineRuns; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int s = 0; s < n_splits; ++s) {
    const float* po = part_o + (((slot0 + s) * a.n_groups + hg) * 512 + cb * 64) * hc;
    float4 o[kCombineRuns];
#pragma unroll
    for (int i = 0; i < kCombineRuns; ++i) {
      const int r = static_cast<int>(threadIdx.x) + i * kCombineThreads;
      if (r < n_runs) o[i] = __ldg(reinterpret_cast<const float4*>(po) + r);  // run r = 4 floats at 4 r
    }
#pragma unroll
    for (int i = 0; i < kCombineRuns; ++i) {
      const int r = static_cast<int>(threadIdx.x) + i * kCombineThreads;
      if (r < n_runs) {
        const float4 w = *reinterpret_cast<const float4*>(weight + s * hc + 4 * (r % runs_per_ch));
        acc[i].x = fmaf(w.x, o[i].x, acc[i].x);
        acc[i].y = fmaf(w.y, o[i].y, acc[i].y);
        acc[i].z = fmaf(w.z, o[i].z, acc[i].z);
        acc[i].w = fmaf(w.w, o[i].w, acc[i].w);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kCombineRuns; ++i) {
    const int r = static_cast<int>(threadIdx.x) + i * kCombineThreads;
    if (r < n_runs) {
      const int ch = r / runs_per_ch, h = 4 * (r % runs_per_ch);
      stage[(h + 0) * 64 + ch] = __float2bfloat16(acc[i].x);
      stage[(h + 1) * 64 + ch] = __float2bfloat16(acc[i].y);
      stage[(h + 2) * 64 + ch] = __float2bfloat16(acc[i].z);
      stage[(h + 3) * 64 + ch] = __float2bfloat16(acc[i].w);
    }
  }
  __syncthreads();
  const int h0 = hg * hc, n_valid = min(hc, a.n_heads - h0);
  bf16* out = a.o_lat + (t * a.n_heads + h0) * 512 + cb * 64;
  for (int v = threadIdx.x; v < n_valid * 8; v += blockDim.x) {
    const int h = v / 8, q = v % 8;
    *reinterpret_cast<uint4*>(out + h * 512 + 8 * q) = *reinterpret_cast<const uint4*>(stage + h * 64 + 8 * q);
  }
}

void check_inputs(const MlaDecodePlan& plan, const MlaDecodeTensors& x, const MlaPagedCache& c,
                  const MlaDecodeContext& ctx) {
  constexpr const char* op = "mla_decode_cuda";
  const MlaParams& p = plan.params;
  BG_CHECK(mla_decode_takes(p) && plan.n_groups >= 1 && plan.n_partitions >= 1 && plan.ws.total_bytes > 0,
           "{}: the plan was not made by mla_decode_plan", op);
  BG_CHECK(x.q && x.w_uk && x.w_uv && x.out, "{}: null q / w_uk / w_uv / out", op);
  BG_CHECK(cuda::aligned_to(x.q, 2) && cuda::aligned_to(x.w_uk, 2) && cuda::aligned_to(x.w_uv, 2) &&
               cuda::aligned_to(x.out, 2),
           "{}: q / w_uk / w_uv / out must be bf16-aligned", op);
  BG_CHECK(c.base && c.block_tables && c.seq_idx && c.positions, "{}: null cache pointer", op);
  BG_CHECK(cuda::aligned_to(c.base, 16) && c.block_stride % 8 == 0,
           "{}: the latent cache base and block stride ({} elements) must be 16-byte aligned", op, c.block_stride);
  BG_CHECK(c.block_stride >= p.block_size * kMlaDecodeEntry, "{}: block_stride {} must be >= block_size {} * {}", op,
           c.block_stride, p.block_size, kMlaDecodeEntry);
  BG_CHECK(c.max_blocks_per_seq > 0, "{}: max_blocks_per_seq {} must be positive", op, c.max_blocks_per_seq);
  BG_CHECK(ctx.cublas && ctx.cublas_workspace && ctx.cublas_workspace_bytes > 0,
           "{}: a cuBLAS handle and workspace are required", op);
  BG_CHECK(ctx.workspace && cuda::aligned_to(ctx.workspace, 256) && ctx.workspace_bytes >= plan.ws.total_bytes,
           "{}: workspace of {} bytes (256-byte aligned) required, got {} bytes", op, plan.ws.total_bytes,
           ctx.workspace_bytes);
}

// C[h] = op(A[h]) * B[h] for every head h (bf16 in and out, fp32 accumulation), column-major as cuBLAS sees it.
struct BatchedGemm {
  cublasOperation_t op_a;
  int m, n, k;
  const bf16* a;
  int lda;
  int64_t stride_a;
  const bf16* b;
  int ldb;
  int64_t stride_b;
  bf16* c;
  int ldc;
  int64_t stride_c;
  int batch;
};

void run_gemm(const MlaDecodeContext& ctx, const BatchedGemm& g) {
  const float one = 1.0f, zero = 0.0f;
  BG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(ctx.cublas, g.op_a, CUBLAS_OP_N, g.m, g.n, g.k, &one, g.a, CUDA_R_16BF,
                                             g.lda, g.stride_a, g.b, CUDA_R_16BF, g.ldb, g.stride_b, &zero, g.c,
                                             CUDA_R_16BF, g.ldc, g.stride_c, g.batch, CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void mla_decode_cuda(const MlaDecodePlan& plan, const MlaDecodeTensors& x, const MlaPagedCache& cache,
                     const MlaDecodeContext& ctx, cudaStream_t stream) {
  check_inputs(plan, x, cache, ctx);
  const MlaParams& p = plan.params;
  const int n = static_cast<int>(p.n_tokens), h = static_cast<int>(p.n_heads);
  const int nope = static_cast<int>(p.qk_nope_dim), qk = nope + static_cast<int>(kMlaDecodeRope);
  const int v_dim = static_cast<int>(p.v_head_dim);
  auto* ws = static_cast<uint8_t*>(ctx.workspace);
  auto* q_full = reinterpret_cast<bf16*>(ws + plan.ws.q_full);
  auto* o_lat = reinterpret_cast<bf16*>(ws + plan.ws.o_lat);
  auto* meta = reinterpret_cast<int32_t*>(ws + plan.ws.meta);

  // cublasSetStream resets the workspace to cuBLAS's own pool, so the caller's workspace is bound after it.
  BG_CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
  BG_CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, ctx.cublas_workspace_bytes));
  // 1. q_full[t, h, 0:512] = q_nope[t, h] · W_UK[h]. Column-major per head: C [512, n] (rows of q_full, ld H·576) =
  //    A [512, nope] (W_UK[h] [nope, 512] row-major, ld 512) · B [nope, n] (q_nope rows, ld H·qk).
  // A per-token plan (--deterministic) runs each token's GEMM on its own (n = 1): cuBLAS picks its kernel by the
  // shape, so a token's result must not depend on how many tokens share the step.
  const int gemm_tokens = plan.per_token ? 1 : n;
  for (int t0 = 0; t0 < n; t0 += gemm_tokens) {
    run_gemm(ctx, {CUBLAS_OP_N, 512, gemm_tokens, nope, x.w_uk, 512, int64_t{nope} * 512, x.q + int64_t{t0} * h * qk,
                   h * qk, qk, q_full + int64_t{t0} * h * 576, h * 576, 576, h});
  }

  // 2. Schedule (CTA 0) and q_pe -> q_full[:, :, 512:576] (the other CTAs).
  const bool vec = cuda::aligned_to(x.q, 16) && nope % 8 == 0 && qk % 8 == 0;
  const int64_t copy_work = int64_t{n} * h * (vec ? 8 : 64);
  const int copy_ctas = static_cast<int>(std::min<int64_t>(kCopyCtas, (copy_work + kPrepThreads - 1) / kPrepThreads));
  const PrepArgs prep{x.q, q_full, meta, cache, n, h, nope, qk, static_cast<int>(p.block_size),
                      static_cast<int>(plan.n_partitions), static_cast<int>(plan.min_tiles_per_partition),
                      plan.per_token, plan.align_tokens};
  if (vec) {
    prep_kernel<true><<<1 + copy_ctas, kPrepThreads, 0, stream>>>(prep);
  } else {
    prep_kernel<false><<<1 + copy_ctas, kPrepThreads, 0, stream>>>(prep);
  }
  BG_CUDA_CHECK_LAUNCH();

  // 3. Attention over the paged cache.
  const AttentionArgs attn = mla_decode::attention_args(plan, cache, ctx.workspace);
  mla_decode::launch_attention(plan, attn, stream);

  // 4. Merge the split tokens' partials (a per-token plan splits nothing).
  if (plan.max_slots > 0) {
    const CombineArgs comb{attn.part_o, attn.part_ml, meta, o_lat, n, h, static_cast<int>(plan.n_groups),
                           static_cast<int>(plan.group_heads)};
    const size_t comb_smem = static_cast<size_t>(plan.n_partitions * plan.group_heads) * 4 +
                             static_cast<size_t>(plan.group_heads) * 64 * 2;
    BG_CUDA_CHECK(cudaFuncSetAttribute(combine_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(comb_smem)));
    combine_kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(plan.n_groups), 512 / 64), kCombineThreads,
                     comb_smem, stream>>>(comb);
    BG_CUDA_CHECK_LAUNCH();
  }

  // 5. out[t, h, :] = o_lat[t, h] · W_UV[h]ᵀ. Column-major per head: C [v, n] (ld H·v) = Aᵀ with A [512, v]
  //    (W_UV[h] [v, 512] row-major, ld 512) · B [512, n] (o_lat rows, ld H·512).
  for (int t0 = 0; t0 < n; t0 += gemm_tokens) {
    run_gemm(ctx, {CUBLAS_OP_T, v_dim, gemm_tokens, 512, x.w_uv, 512, int64_t{v_dim} * 512, o_lat + int64_t{t0} * h * 512,
                   h * 512, 512, x.out + int64_t{t0} * h * v_dim, h * v_dim, v_dim, h});
  }
}

namespace mla_decode {

AttentionArgs attention_args(const MlaDecodePlan& plan, const MlaPagedCache& cache, void* workspace) {
  auto* ws = static_cast<uint8_t*>(workspace);
  const MlaParams& p = plan.params;
  return {reinterpret_cast<const bf16*>(ws + plan.ws.q_full),
          reinterpret_cast<bf16*>(ws + plan.ws.o_lat),
          reinterpret_cast<float*>(ws + plan.ws.part_o),
          reinterpret_cast<float*>(ws + plan.ws.part_ml),
          reinterpret_cast<const int32_t*>(ws + plan.ws.meta),
          cache,
          static_cast<int>(p.n_tokens),
          static_cast<int>(p.n_heads),
          static_cast<int>(plan.n_groups),
          static_cast<int>(p.block_size),
          p.softmax_scale * kLog2e};
}

}  // namespace mla_decode

size_t mla_decode_attention_smem_bytes(const MlaDecodePlan& plan) { return mla_decode::attention_smem_bytes(plan); }

MlaDecodeKernelInfo mla_decode_attention_kernel_info(const MlaDecodePlan& plan) {
  return mla_decode::attention_kernel_info(plan);
}

}  // namespace bg::ops

// Chunked KDA prefill on tensor cores (K = V = 128): a parallel "prepare" kernel over (chunk, head) and a
// recurrence kernel over (sequence, head) that carries the 128 x 128 state through the chunks; the launchers
// kda_chunked_cuda (one sequence) and kda_chunked_varlen_cuda (every chunked sequence of a step, one launch pair).
// docs/KDA.md has the algorithm, the precision argument and the measured times.
//
// Notation per chunk (n <= 64 tokens, padded to 64 with k = q = v = 0, g = 0, beta = 0, so padded rows contribute
// exact zeros and G_63 = G_{n-1}): G_i the cumulative log decay inside the chunk, Kt_ij = k_i . (e^{G_i - G_j} k_j),
//   A = diag(beta) strictly_lower(Kt),  T = (I + A)^-1,  T' = T diag(beta),
//   W = T' (k o e^G),  U = T' v,  Aqk = lower(q_i . e^{G_i - G_j} k_j),  qg = q o e^G,  kg = k o e^{G_last - G}.
// Kernel 1 writes W, U, qg, kg^T, Aqk and e^{G_last} into the workspace; kernel 2, per chunk from state S:
//   v_new = U - W S;  o = qg S + Aqk v_new;  S <- e^{G_last} o S + kg^T v_new.
// This is kda_cpu.cpp's chunk algebra: v_new is its u (the UT transform applied to v - S^T e^G k).
//
// Exponents: A and Aqk are products of two factors over 16-token sub-blocks with a reference token r: row block a,
// column block b < a use r = the last token of b, so k_i e^{G_i - G_r} and k_j e^{G_r - G_j} are both <= 1; the
// diagonal blocks use r = the block's token 8, so either factor is at most e^{8 * 5} = e^40 under K3's gate bound
// (g >= -5 per step; finite in fp32 down to g = -11), and their product, for i >= j, is <= 1. Every other factor is
// e^{G_i} or e^{G_last - G_j}, <= 1.
//
// Precision: mma.sync m16n8k16 bf16 with fp32 accumulation. Every operand that is not exactly a bf16 input is split
// x = hi + lo (two bf16, 16 significant bits), and a product is hi.hi + hi.lo + lo.hi (lo.lo dropped), so the state
// path (A, T, W, U, v_new, S) keeps about 2^-17 relative accuracy per term; T comes from an fp32 forward substitution.
// The output-only operands (qg, Aqk) are rounded to bf16 once (the output is bf16).
#include <cuda_bf16.h>

#include <cstdint>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/kda/kda_cuda.h"
#include "ops/kda/kda_varlen_plan.h"

namespace bg::ops {
namespace {

constexpr int kDim = 128;   // K = V
constexpr int kChunk = 64;  // tokens per chunk
static_assert(kChunk == kKdaDefaultChunkSize && kDim == kKdaCudaHeadDim, "the tensor-core path is laid out for these");
constexpr int kPrepThreads = 320;   // kernel 1: 10 warps (one per 16x16 block pair of A)
constexpr int kRecurThreads = 512;  // kernel 2: 16 warps

// Workspace of one (chunk, head), byte offsets. "A tiles" are 16x16 bf16 mma A fragments stored lane-major (lane l's
// four registers at 16 l, 512 B a tile, row-major over the tile grid); "C tiles" are 16x8 fp32 accumulators, same way.
constexpr int kTileBytes = 512;
constexpr int kWsWHi = 0;                           // W [64 tok, 128 key]: A tiles 4 x 8, hi
constexpr int kWsWLo = kWsWHi + 32 * kTileBytes;    // ... lo
constexpr int kWsQg = kWsWLo + 32 * kTileBytes;     // qg [64 tok, 128 key]: A tiles 4 x 8 (bf16)
constexpr int kWsU = kWsQg + 32 * kTileBytes;       // U [64 tok, 128 val]: C tiles 4 x 16 (fp32)
constexpr int kWsDecay = kWsU + 64 * kTileBytes;    // e^{G_last} [128] fp32
constexpr int kWsPartA = kWsDecay + kDim * 4;       // end of part A (read by step A), start of part B
constexpr int kWsKgHi = kWsPartA;                   // kg^T [128 key, 64 tok]: A tiles 8 x 4, hi
constexpr int kWsKgLo = kWsKgHi + 32 * kTileBytes;  // ... lo
constexpr int kWsAqk = kWsKgLo + 32 * kTileBytes;  // Aqk [64, 64]: A tiles 4 x 4 (bf16; above the diagonal unused)
constexpr int kWsBytes = kWsAqk + 16 * kTileBytes;  // 123392
constexpr int kWsPartBBytes = kWsBytes - kWsPartA;
static_assert(kWsPartA % 16 == 0 && kWsBytes % 16 == 0, "16-byte copies");

// Shared-memory rows of bf16 [*, 128] matrices are padded to 136 (272 B): the 8 rows an ldmatrix reads land in
// 8 different 16-byte bank groups.
constexpr int kRowBf16 = kDim + 8;
constexpr int kGStride = kDim + 4;    // kernel 1 G [64, 132] fp32
constexpr int kAStride = kChunk + 1;  // kernel 1 A, T [64, 65] fp32

// ---- primitives ----------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
// 16 bytes, of which the first src_bytes (0 or 16) are read and the rest zero-filled.
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16 row) * b (16x8 col), bf16 operands, fp32 accumulate.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// d += (a_hi + a_lo)(b_hi + b_lo) without the lo.lo term.
__device__ __forceinline__ void mma3(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                     uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma(d, ah, bh0, bh1);
  mma(d, ah, bl0, bl1);
  mma(d, al, bh0, bh1);
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ uint32_t pack(float x0, float x1) { return bits(__floats2bfloat162_rn(x0, x1)); }
// (x0, x1) = hi + lo, each a bf16 pair (x0 in the low half, as the mma fragments order elements).
__device__ __forceinline__ void split(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  hi = bits(h);
  lo = pack(x0 - __low2float(h), x1 - __high2float(h));
}
__device__ __forceinline__ float bf(__nv_bfloat16 x) { return __bfloat162float(x); }
// Two consecutive shared-memory elements (8- / 4-byte aligned: an even column of a row with an even stride).
__device__ __forceinline__ float2 ld_f2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 ld_bf2(const __nv_bfloat16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// Element e (0..7) of a lane's A fragment (16x16): row g + 8 (e>>1 & 1), column 2t + (e & 1) + 8 (e >> 2).
__device__ __forceinline__ int a_row(int g, int e) { return g + ((e & 2) ? 8 : 0); }
__device__ __forceinline__ int a_col(int t, int e) { return 2 * t + (e & 1) + ((e & 4) ? 8 : 0); }
// Element e (0..3) of a lane's B fragment (16x8): k = 2t + (e & 1) + 8 (e >> 1), n = g.
__device__ __forceinline__ int b_k(int t, int e) { return 2 * t + (e & 1) + ((e & 2) ? 8 : 0); }

struct Chunk {
  int32_t token_begin, n_tokens;
};
// Chunk c of the launch: from the plan table, or (no plan: one sequence of n_tokens) the c-th run of 64 tokens.
__device__ __forceinline__ Chunk chunk_at(const int32_t* plan, int64_t n_tokens, int64_t c) {
  if (plan != nullptr) return {plan[2 * c], plan[2 * c + 1]};
  const int64_t t0 = c * kChunk;
  return {static_cast<int32_t>(t0), static_cast<int32_t>(n_tokens - t0 < kChunk ? n_tokens - t0 : kChunk)};
}

struct TcArgs {
  KdaCudaInputs in;
  __nv_bfloat16* out;
  uint8_t* ws;
  const int32_t* plan;  // null: one sequence, chunks of 64 from token 0
  int64_t n_tokens;     // the single sequence's length (plan == null)
  int64_t n_chunks;
  float* state_base;  // slot 0 (plan) or the sequence's state
  int64_t slot_stride;
  int n_heads;
};

// ---- kernel 1: per (chunk, head) -----------------------------------------------------------------------------------

struct PrepSmem {
  __nv_bfloat16* k;  // [64, 136]
  __nv_bfloat16* q;  // [64, 136]; after the A / qg phase, T [64, 65] fp32 lives here
  __nv_bfloat16* v;  // [64, 136]
  float* g;          // [64, 132] cumulative G
  float* a;          // [64, 65] A = diag(beta) strictly_lower(Kt)
  float* beta;       // [64]
  float* x;          // [16, 65] block-row scratch of the inverse
  __device__ float* t() const { return reinterpret_cast<float*>(q); }
};
constexpr int kPrepBf16Bytes = kChunk * kRowBf16 * 2;
constexpr int kPrepSmemBytes =
    3 * kPrepBf16Bytes + kChunk * kGStride * 4 + kChunk * kAStride * 4 + kChunk * 4 + 16 * kAStride * 4;
static_assert(2 * (kPrepSmemBytes + 1024) <= 233472, "two prepare CTAs per SM");
static_assert(20 * kTileBytes <= kChunk * kAStride * 4, "the T' tiles fit where A was");
static_assert(kChunk * kAStride * 4 <= kPrepBf16Bytes, "T fits where q was");

__device__ PrepSmem prep_smem(uint8_t* base) {
  PrepSmem m;
  m.k = reinterpret_cast<__nv_bfloat16*>(base);
  m.q = m.k + kChunk * kRowBf16;
  m.v = m.q + kChunk * kRowBf16;
  m.g = reinterpret_cast<float*>(m.v + kChunk * kRowBf16);
  m.a = m.g + kChunk * kGStride;
  m.beta = m.a + kChunk * kAStride;
  m.x = m.beta + kChunk;
  return m;
}

// q, k, v rows and the raw g rows by cp.async, all in flight at once (rows past n zero-filled), beta; then G by a
// running sum per channel in token order (the CPU's order), in place. Ends with a barrier.
__device__ void prep_load(const TcArgs& x, int h, Chunk ch, const PrepSmem& m) {
  const int tid = threadIdx.x;
  constexpr int kBf16Chunks = kDim / 8, kF32Chunks = kDim / 4;  // 16-byte pieces of a q / k / v row, of a g row
  // Consecutive threads copy consecutive 16-byte pieces of one row: k, q, v (1024 pieces each), then g (2048).
  for (int idx = tid; idx < kChunk * (3 * kBf16Chunks + kF32Chunks); idx += kPrepThreads) {
    const bool bf16_part = idx < 3 * kChunk * kBf16Chunks;
    const int rem = bf16_part ? idx % (kChunk * kBf16Chunks) : idx - 3 * kChunk * kBf16Chunks;
    const int i = bf16_part ? rem / kBf16Chunks : rem / kF32Chunks;
    const bool live = i < ch.n_tokens;
    const int64_t row = (static_cast<int64_t>(ch.token_begin) + (live ? i : 0)) * x.n_heads + h;
    const void* src;
    uint32_t dst;
    if (bf16_part) {
      const int which = idx / (kChunk * kBf16Chunks), c8 = (rem % kBf16Chunks) * 8;
      const __nv_bfloat16* base = which == 0 ? x.in.k : (which == 1 ? x.in.q : x.in.v);
      __nv_bfloat16* smem = which == 0 ? m.k : (which == 1 ? m.q : m.v);
      src = base + row * kDim + c8;
      dst = smem_u32(smem + i * kRowBf16 + c8);
    } else {
      const int c4 = (rem % kF32Chunks) * 4;
      src = x.in.g + row * kDim + c4;
      dst = smem_u32(m.g + i * kGStride + c4);
    }
    cp_async16_zfill(dst, src, live ? 16u : 0u);
  }
  cp_async_commit();
  if (tid < kChunk) {
    m.beta[tid] = tid < ch.n_tokens ? x.in.beta[(static_cast<int64_t>(ch.token_begin) + tid) * x.n_heads + h] : 0.0f;
  }
  cp_async_wait0();
  __syncthreads();
  if (tid < kDim) {
    float run = 0.0f;
#pragma unroll 16
    for (int i = 0; i < kChunk; ++i) {
      run = i == 0 ? m.g[tid] : run + m.g[i * kGStride + tid];
      m.g[i * kGStride + tid] = run;
    }
  }
  __syncthreads();
}

// The 16x16 block (a, b), b <= a, of Kt (-> A, masked and scaled by beta, fp32 in smem) and of the query-key matrix
// (-> Aqk A tile (a, b), bf16, in the workspace); reference token r as described at the top.
__device__ void prep_pair(int a, int b, const PrepSmem& m, uint8_t* ws) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r = a == b ? 16 * b + 8 : 16 * b + 15;
  float kk[2][4] = {}, qk[2][4] = {};
#pragma unroll 1
  for (int ks = 0; ks < kDim / 16; ++ks) {
    uint32_t akh[4], akl[4], aqh[4], aql[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {  // elements e, e + 1: channels d, d + 1 of row i
      const int i = 16 * a + a_row(g, e), d = 16 * ks + a_col(t, e);
      const float2 gi = ld_f2(m.g + i * kGStride + d), gr = ld_f2(m.g + r * kGStride + d);
      const float2 kv = ld_bf2(m.k + i * kRowBf16 + d), qv = ld_bf2(m.q + i * kRowBf16 + d);
      const float f0 = __expf(gi.x - gr.x), f1 = __expf(gi.y - gr.y);
      split(kv.x * f0, kv.y * f1, akh[e / 2], akl[e / 2]);
      split(qv.x * f0, qv.y * f1, aqh[e / 2], aql[e / 2]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int j = 16 * b + 8 * nt + g;
      uint32_t bh[2], bl[2];
#pragma unroll
      for (int e = 0; e < 4; e += 2) {  // elements e, e + 1: channels d, d + 1 of row j
        const int d = 16 * ks + b_k(t, e);
        const float2 gr = ld_f2(m.g + r * kGStride + d), gj = ld_f2(m.g + j * kGStride + d);
        const float2 kv = ld_bf2(m.k + j * kRowBf16 + d);
        split(kv.x * __expf(gr.x - gj.x), kv.y * __expf(gr.y - gj.y), bh[e / 2], bl[e / 2]);
      }
      mma3(kk[nt], akh, akl, bh[0], bh[1], bl[0], bl[1]);
      mma3(qk[nt], aqh, aql, bh[0], bh[1], bl[0], bl[1]);
    }
  }
  // Accumulator element e of n-tile nt: row 16a + g + 8 (e >> 1), column 16b + 8 nt + 2t + (e & 1).
  uint32_t aqk[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float masked[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * a + g + ((e & 2) ? 8 : 0), j = 16 * b + 8 * nt + 2 * t + (e & 1);
      m.a[i * kAStride + j] = j < i ? m.beta[i] * kk[nt][e] : 0.0f;
      masked[e] = j <= i ? qk[nt][e] : 0.0f;
    }
    aqk[2 * nt] = pack(masked[0], masked[1]);  // A fragment: regs 0, 1 from n-tile 0, regs 2, 3 from n-tile 1
    aqk[2 * nt + 1] = pack(masked[2], masked[3]);
  }
  *reinterpret_cast<uint4*>(ws + kWsAqk + (4 * a + b) * kTileBytes + lane * 16) = {aqk[0], aqk[1], aqk[2], aqk[3]};
}

// qg = q o e^G (A tiles 4 x 8, bf16) and kg^T = (k o e^{G_last - G})^T (A tiles 8 x 4, hi / lo): tile `tile` of 32.
__device__ void prep_scaled_tiles(int tile, const PrepSmem& m, uint8_t* ws) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  {
    const int mt = tile / 8, kt = tile % 8;
    uint32_t r[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const int i = 16 * mt + a_row(g, e), d = 16 * kt + a_col(t, e);
      const float2 qv = ld_bf2(m.q + i * kRowBf16 + d), gi = ld_f2(m.g + i * kGStride + d);
      r[e / 2] = pack(qv.x * __expf(gi.x), qv.y * __expf(gi.y));
    }
    *reinterpret_cast<uint4*>(ws + kWsQg + tile * kTileBytes + lane * 16) = {r[0], r[1], r[2], r[3]};
  }
  {
    const int mt = tile / 4, kt = tile % 4;  // rows: key channels, columns: tokens
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      float x[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int d = 16 * mt + a_row(g, e + u), j = 16 * kt + a_col(t, e + u);
        x[u] = bf(m.k[j * kRowBf16 + d]) * __expf(m.g[(kChunk - 1) * kGStride + d] - m.g[j * kGStride + d]);
      }
      split(x[0], x[1], hi[e / 2], lo[e / 2]);
    }
    *reinterpret_cast<uint4*>(ws + kWsKgHi + tile * kTileBytes + lane * 16) = {hi[0], hi[1], hi[2], hi[3]};
    *reinterpret_cast<uint4*>(ws + kWsKgLo + tile * kTileBytes + lane * 16) = {lo[0], lo[1], lo[2], lo[3]};
  }
}

// T = (I + A)^-1 (unit lower triangular, fp32) by blocks of 16: the four diagonal blocks by forward substitution at
// once (column j by the 4 lanes 4j .. 4j + 3), then block row a = 1, 2, 3 in turn:
//   T[a, 0:a] = -T_aa (A[a, 0:a] T[0:a, 0:a])   (16 x 16a, reading only rows of earlier block rows).
__device__ void prep_inverse(const PrepSmem& m) {
  float* tm = m.t();
  for (int idx = threadIdx.x; idx < kChunk * kChunk; idx += kPrepThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    tm[i * kAStride + j] = i == j ? 1.0f : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < 4 * kChunk) {  // warps 0..7
    const int j = threadIdx.x / 4, part = threadIdx.x % 4, blk = 16 * (j / 16);  // a warp's 8 columns share a block
    for (int i = blk + 1; i < blk + 16; ++i) {
      float acc = 0.0f;
      if (i > j) {
        for (int mm = j + part; mm < i; mm += 4) acc = fmaf(m.a[i * kAStride + mm], tm[mm * kAStride + j], acc);
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      if (part == 0 && i > j) tm[i * kAStride + j] = -acc;
      __syncwarp();  // row i of this column is read by its 4 lanes from the next row on
    }
  }
  __syncthreads();
  for (int a = 1; a < kChunk / 16; ++a) {
    const int n_cols = 16 * a;  // columns 0 .. 16a - 1 of block row a
    for (int idx = threadIdx.x; idx < 16 * n_cols; idx += kPrepThreads) {
      const int i = idx / n_cols, col = idx % n_cols;
      float acc = 0.0f;
      for (int mm = col; mm < n_cols; ++mm) acc = fmaf(m.a[(n_cols + i) * kAStride + mm], tm[mm * kAStride + col], acc);
      m.x[i * kAStride + col] = acc;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * n_cols; idx += kPrepThreads) {
      const int i = idx / n_cols, col = idx % n_cols;
      float acc = 0.0f;
      for (int mm = 0; mm <= i; ++mm)
        acc = fmaf(tm[(n_cols + i) * kAStride + n_cols + mm], m.x[mm * kAStride + col], acc);
      tm[(n_cols + i) * kAStride + col] = -acc;
    }
    __syncthreads();
  }
}

// The 10 nonzero A tiles (mt, ks <= mt) of T' = T diag(beta), hi / lo, as mma fragments into the dead A buffer:
// tile mt (mt + 1) / 2 + ks by warp of the same number. Ends with a barrier.
__device__ void prep_tprime(const PrepSmem& m) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  if (w < 10) {
    const int mt = w >= 6 ? 3 : (w >= 3 ? 2 : (w >= 1 ? 1 : 0)), ks = w - mt * (mt + 1) / 2;
    const float* tm = m.t();
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const int i = 16 * mt + a_row(g, e), j = 16 * ks + a_col(t, e);
      split(tm[i * kAStride + j] * m.beta[j], tm[i * kAStride + j + 1] * m.beta[j + 1], hi[e / 2], lo[e / 2]);
    }
    uint8_t* tiles = reinterpret_cast<uint8_t*>(m.a);
    *reinterpret_cast<uint4*>(tiles + w * kTileBytes + lane * 16) = {hi[0], hi[1], hi[2], hi[3]};
    *reinterpret_cast<uint4*>(tiles + (10 + w) * kTileBytes + lane * 16) = {lo[0], lo[1], lo[2], lo[3]};
  }
  __syncthreads();
}

// W = T' (k o e^G) and U = T' v for the key / value columns 16w .. 16w + 15 of warp w; T' = T diag(beta).
template <bool kIsW>
__device__ void prep_wu(const PrepSmem& m, uint8_t* ws) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  if (w >= kDim / 16) return;  // warps 8, 9: no column block
  const uint8_t* tiles = reinterpret_cast<const uint8_t*>(m.a);
  float acc[4][2][4] = {};
#pragma unroll 1
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t bh[2][2], bl[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int d = 16 * w + 8 * nt + g;
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int j0 = 16 * ks + b_k(t, e);  // j0 + 1 is element e + 1
        if constexpr (kIsW) {
          split(bf(m.k[j0 * kRowBf16 + d]) * __expf(m.g[j0 * kGStride + d]),
                bf(m.k[(j0 + 1) * kRowBf16 + d]) * __expf(m.g[(j0 + 1) * kGStride + d]), bh[nt][e / 2], bl[nt][e / 2]);
        } else {
          bh[nt][e / 2] = bits(__halves2bfloat162(m.v[j0 * kRowBf16 + d], m.v[(j0 + 1) * kRowBf16 + d]));
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt < ks) continue;  // T' is lower triangular
      uint32_t ah[4], al[4];
      const int tile = mt * (mt + 1) / 2 + ks;
      const uint4 h4 = *reinterpret_cast<const uint4*>(tiles + tile * kTileBytes + lane * 16);
      const uint4 l4 = *reinterpret_cast<const uint4*>(tiles + (10 + tile) * kTileBytes + lane * 16);
      ah[0] = h4.x, ah[1] = h4.y, ah[2] = h4.z, ah[3] = h4.w;
      al[0] = l4.x, al[1] = l4.y, al[2] = l4.z, al[3] = l4.w;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if constexpr (kIsW) {
          mma3(acc[mt][nt], ah, al, bh[nt][0], bh[nt][1], bl[nt][0], bl[nt][1]);
        } else {
          mma(acc[mt][nt], ah, bh[nt][0], bh[nt][1]);  // v is exact in bf16
          mma(acc[mt][nt], al, bh[nt][0], bh[nt][1]);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    if constexpr (kIsW) {
      // Columns 16w .. 16w + 15 are A tile (mt, w) of W; n-tile 0 gives registers 0, 1 and n-tile 1 registers 2, 3.
      uint32_t hi[4], lo[4];
      split(acc[mt][0][0], acc[mt][0][1], hi[0], lo[0]);
      split(acc[mt][0][2], acc[mt][0][3], hi[1], lo[1]);
      split(acc[mt][1][0], acc[mt][1][1], hi[2], lo[2]);
      split(acc[mt][1][2], acc[mt][1][3], hi[3], lo[3]);
      const int off = (mt * 8 + w) * kTileBytes + lane * 16;
      *reinterpret_cast<uint4*>(ws + kWsWHi + off) = {hi[0], hi[1], hi[2], hi[3]};
      *reinterpret_cast<uint4*>(ws + kWsWLo + off) = {lo[0], lo[1], lo[2], lo[3]};
    } else {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        *reinterpret_cast<float4*>(ws + kWsU + (mt * 16 + 2 * w + nt) * kTileBytes + lane * 16) =
            make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
  }
}

// grid (n_chunks, n_heads), block 320, dynamic shared memory kPrepSmemBytes.
__global__ void __launch_bounds__(kPrepThreads, 2) kda_tc_prepare_kernel(TcArgs x) {
  extern __shared__ float4 smem_f4[];
  const PrepSmem m = prep_smem(reinterpret_cast<uint8_t*>(smem_f4));
  const int64_t c = blockIdx.x;
  const int h = blockIdx.y, w = threadIdx.x / 32;
  const Chunk ch = chunk_at(x.plan, x.n_tokens, c);
  uint8_t* ws = x.ws + (c * x.n_heads + h) * static_cast<int64_t>(kWsBytes);
  prep_load(x, h, ch, m);
  // The 10 blocks (a, b), b <= a, of A / Aqk: pair p = a (a + 1) / 2 + b -> warp p; then the 32 qg / kg^T tiles.
  static_assert(kPrepThreads / 32 == 10, "one warp per block pair");
  {
    const int a = w >= 6 ? 3 : (w >= 3 ? 2 : (w >= 1 ? 1 : 0));
    prep_pair(a, w - a * (a + 1) / 2, m, ws);
  }
  for (int tile = w; tile < 32; tile += kPrepThreads / 32) prep_scaled_tiles(tile, m, ws);
  if (threadIdx.x < kDim) {
    reinterpret_cast<float*>(ws + kWsDecay)[threadIdx.x] = __expf(m.g[(kChunk - 1) * kGStride + threadIdx.x]);
  }
  __syncthreads();  // A complete; q is dead, T takes its place
  prep_inverse(m);  // ends with a barrier
  prep_tprime(m);   // likewise
  prep_wu<true>(m, ws);
  prep_wu<false>(m, ws);
}

// ---- kernel 2: per (sequence, head), chunks in order ---------------------------------------------------------------

// Shared memory: the workspace parts A and B of the current chunk (copied verbatim), S as hi / lo bf16 [128, 136]
// (the B operand of step A) and v_new as hi / lo bf16 [64, 136] (the B operand of steps C and D).
constexpr int kRecSmemPartA = 0;
constexpr int kRecSmemPartB = kRecSmemPartA + kWsPartA;
constexpr int kRecSmemS = kRecSmemPartB + kWsPartBBytes;
constexpr int kRecSmemV = kRecSmemS + 2 * kDim * kRowBf16 * 2;
constexpr int kRecSmemBytes = kRecSmemV + 2 * kChunk * kRowBf16 * 2;
static_assert(kRecSmemBytes <= 232448, "over the 227 KiB a CTA may use");

__device__ __forceinline__ void copy_part(uint32_t dst, const uint8_t* src, int bytes) {
  for (int off = threadIdx.x * 16; off < bytes; off += kRecurThreads * 16) cp_async16(dst + off, src + off);
}

// Accumulator element e of a 16x8 tile -> (row + 8 (e >> 1), col + (e & 1)); pairs (e, e + 1) go out as one word.
__device__ __forceinline__ void store_split(__nv_bfloat16* hi, __nv_bfloat16* lo, int row, int col, const float* v) {
  uint32_t h0, l0, h1, l1;
  split(v[0], v[1], h0, l0);
  split(v[2], v[3], h1, l1);
  *reinterpret_cast<uint32_t*>(hi + row * kRowBf16 + col) = h0;
  *reinterpret_cast<uint32_t*>(lo + row * kRowBf16 + col) = l0;
  *reinterpret_cast<uint32_t*>(hi + (row + 8) * kRowBf16 + col) = h1;
  *reinterpret_cast<uint32_t*>(lo + (row + 8) * kRowBf16 + col) = l1;
}

// B fragments of n-tiles (2p, 2p + 1) for k-step ks from a row-major [k, n] bf16 matrix at column offset col0.
__device__ __forceinline__ void load_b(uint32_t (&r)[4], uint32_t base, int ks, int col0, int lane) {
  const int mat = lane / 8, row = 16 * ks + 8 * (mat % 2) + lane % 8, col = col0 + 8 * (mat / 2);
  ldsm_x4_trans(r, base + (row * kRowBf16 + col) * 2);
}

__device__ __forceinline__ void load_a(uint32_t (&r)[4], const uint8_t* tile, int lane) {
  const uint4 v = *reinterpret_cast<const uint4*>(tile + lane * 16);
  r[0] = v.x;
  r[1] = v.y;
  r[2] = v.z;
  r[3] = v.w;
}

// One warp of the recurrence kernel: row tile rt = w % 4 (tokens 16 rt .. of v_new and o; state rows 32 rt ..),
// value quarter cq = w / 4 (columns 32 cq ..), and the shared-memory buffers.
struct RecWarp {
  const uint8_t* part_a;  // workspace part A of the current chunk (W, qg, U, e^{G_last})
  const uint8_t* part_b;  // workspace part B (kg^T, Aqk)
  __nv_bfloat16 *s_hi, *s_lo, *v_hi, *v_lo;
  uint32_t s_hi_u, s_lo_u, v_hi_u, v_lo_u;  // the same, as shared-memory addresses
  int lane, rt, cq, g, t;
};

// State rows 32 rt + 16 mi + g (+8), columns 32 cq + 8 ni + 2t (+1), in accumulator layout: from / to global memory.
__device__ __forceinline__ void rec_load_state(const RecWarp& r, const float* state, float (&s)[2][4][4]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int row = 32 * r.rt + 16 * mi + r.g, col = 32 * r.cq + 8 * ni + 2 * r.t;
      const float2 lo = *reinterpret_cast<const float2*>(state + row * kDim + col);
      const float2 hi = *reinterpret_cast<const float2*>(state + (row + 8) * kDim + col);
      s[mi][ni][0] = lo.x;
      s[mi][ni][1] = lo.y;
      s[mi][ni][2] = hi.x;
      s[mi][ni][3] = hi.y;
      store_split(r.s_hi, r.s_lo, row, col, s[mi][ni]);
    }
  }
}
__device__ __forceinline__ void rec_store_state(const RecWarp& r, float* state, const float (&s)[2][4][4]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int row = 32 * r.rt + 16 * mi + r.g, col = 32 * r.cq + 8 * ni + 2 * r.t;
      *reinterpret_cast<float2*>(state + row * kDim + col) = make_float2(s[mi][ni][0], s[mi][ni][1]);
      *reinterpret_cast<float2*>(state + (row + 8) * kDim + col) = make_float2(s[mi][ni][2], s[mi][ni][3]);
    }
  }
}

// Step A: vn = W S and o = qg S for this warp's rows and columns (K = 128); then v_new = U - W S into shared
// memory (hi / lo), leaving v_new in vn.
__device__ __forceinline__ void rec_step_a(const RecWarp& r, float (&vn)[4][4], float (&o)[4][4]) {
#pragma unroll 2
  for (int ks = 0; ks < kDim / 16; ++ks) {
    uint32_t wh[4], wl[4], qg[4];
    load_a(wh, r.part_a + kWsWHi + (r.rt * 8 + ks) * kTileBytes, r.lane);
    load_a(wl, r.part_a + kWsWLo + (r.rt * 8 + ks) * kTileBytes, r.lane);
    load_a(qg, r.part_a + kWsQg + (r.rt * 8 + ks) * kTileBytes, r.lane);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      uint32_t bh[4], bl[4];
      load_b(bh, r.s_hi_u, ks, 32 * r.cq + 16 * p, r.lane);
      load_b(bl, r.s_lo_u, ks, 32 * r.cq + 16 * p, r.lane);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mma3(vn[2 * p + u], wh, wl, bh[2 * u], bh[2 * u + 1], bl[2 * u], bl[2 * u + 1]);
        mma(o[2 * p + u], qg, bh[2 * u], bh[2 * u + 1]);
        mma(o[2 * p + u], qg, bl[2 * u], bl[2 * u + 1]);
      }
    }
  }
#pragma unroll
  for (int ni = 0; ni < 4; ++ni) {
    const float4 u =
        *reinterpret_cast<const float4*>(r.part_a + kWsU + (r.rt * 16 + 4 * r.cq + ni) * kTileBytes + r.lane * 16);
    vn[ni][0] = u.x - vn[ni][0];
    vn[ni][1] = u.y - vn[ni][1];
    vn[ni][2] = u.z - vn[ni][2];
    vn[ni][3] = u.w - vn[ni][3];
    store_split(r.v_hi, r.v_lo, 16 * r.rt + r.g, 32 * r.cq + 8 * ni + 2 * r.t, vn[ni]);
  }
}

// Step C: o += Aqk v_new over the column blocks ks <= rt, then out (rows < n only).
__device__ __forceinline__ void rec_step_c(const RecWarp& r, float (&o)[4][4], const TcArgs& x, Chunk ch, int h) {
#pragma unroll 1
  for (int ks = 0; ks <= r.rt; ++ks) {
    uint32_t a[4];
    load_a(a, r.part_b + (kWsAqk - kWsPartA) + (r.rt * 4 + ks) * kTileBytes, r.lane);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      uint32_t bh[4], bl[4];
      load_b(bh, r.v_hi_u, ks, 32 * r.cq + 16 * p, r.lane);
      load_b(bl, r.v_lo_u, ks, 32 * r.cq + 16 * p, r.lane);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mma(o[2 * p + u], a, bh[2 * u], bh[2 * u + 1]);
        mma(o[2 * p + u], a, bl[2 * u], bl[2 * u + 1]);
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * r.rt + r.g + 8 * half;
    if (i >= ch.n_tokens) continue;
    __nv_bfloat16* orow =
        x.out + (static_cast<int64_t>(ch.token_begin + i) * x.n_heads + h) * kDim + 32 * r.cq + 2 * r.t;
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      *reinterpret_cast<__nv_bfloat162*>(orow + 8 * ni) = __floats2bfloat162_rn(o[ni][2 * half], o[ni][2 * half + 1]);
    }
  }
}

// Step D: S <- e^{G_last} o S + kg^T v_new (K = 64 tokens) on the accumulators.
__device__ __forceinline__ void rec_step_d(const RecWarp& r, float (&s)[2][4][4], const float (&decay)[2][2]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      s[mi][ni][0] *= decay[mi][0];
      s[mi][ni][1] *= decay[mi][0];
      s[mi][ni][2] *= decay[mi][1];
      s[mi][ni][3] *= decay[mi][1];
    }
  }
#pragma unroll 1
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t bh[2][4], bl[2][4];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      load_b(bh[p], r.v_hi_u, ks, 32 * r.cq + 16 * p, r.lane);
      load_b(bl[p], r.v_lo_u, ks, 32 * r.cq + 16 * p, r.lane);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      uint32_t kh[4], kl[4];
      load_a(kh, r.part_b + (kWsKgHi - kWsPartA) + ((2 * r.rt + mi) * 4 + ks) * kTileBytes, r.lane);
      load_a(kl, r.part_b + (kWsKgLo - kWsPartA) + ((2 * r.rt + mi) * 4 + ks) * kTileBytes, r.lane);
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        mma3(s[mi][ni], kh, kl, bh[ni / 2][2 * (ni % 2)], bh[ni / 2][2 * (ni % 2) + 1], bl[ni / 2][2 * (ni % 2)],
             bl[ni / 2][2 * (ni % 2) + 1]);
      }
    }
  }
}

// grid (n_seqs, n_heads), block 512 (16 warps, see RecWarp), kRecSmemBytes. Per chunk: step A, v_new out, barrier,
// next part A in, step C, step D, barrier, next part B in, S (hi / lo) out; part B of chunk c streams in during step A
// of chunk c, part A of chunk c + 1 during steps C and D of chunk c.
__global__ void __launch_bounds__(kRecurThreads, 1) kda_tc_recurrence_kernel(TcArgs x) {
  extern __shared__ float4 smem_f4[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(smem_f4);
  RecWarp r;
  r.part_a = smem + kRecSmemPartA;
  r.part_b = smem + kRecSmemPartB;
  r.s_hi = reinterpret_cast<__nv_bfloat16*>(smem + kRecSmemS);
  r.s_lo = r.s_hi + kDim * kRowBf16;
  r.v_hi = reinterpret_cast<__nv_bfloat16*>(smem + kRecSmemV);
  r.v_lo = r.v_hi + kChunk * kRowBf16;
  r.s_hi_u = smem_u32(r.s_hi);
  r.s_lo_u = smem_u32(r.s_lo);
  r.v_hi_u = smem_u32(r.v_hi);
  r.v_lo_u = smem_u32(r.v_lo);
  const int w = threadIdx.x / 32;
  r.lane = threadIdx.x % 32;
  r.rt = w % 4;
  r.cq = w / 4;
  r.g = r.lane / 4;
  r.t = r.lane % 4;
  const int h = blockIdx.y;

  int64_t chunk0 = 0, n_chunks = x.n_chunks, slot = 0;
  if (x.plan != nullptr) {
    const int32_t* sd = x.plan + 2 * x.n_chunks + 4 * static_cast<int64_t>(blockIdx.x);
    chunk0 = sd[0];
    n_chunks = sd[1];
    slot = sd[2];
  }
  float* state = x.state_base + slot * x.slot_stride + static_cast<int64_t>(h) * kDim * kDim;
  auto ws_of = [&](int64_t c) { return x.ws + (c * x.n_heads + h) * static_cast<int64_t>(kWsBytes); };

  float s[2][4][4];
  rec_load_state(r, state, s);
  copy_part(smem_u32(smem + kRecSmemPartA), ws_of(chunk0), kWsPartA);
  cp_async_commit();
  copy_part(smem_u32(smem + kRecSmemPartB), ws_of(chunk0) + kWsPartA, kWsPartBBytes);
  cp_async_commit();
#pragma unroll 1
  for (int64_t cc = 0; cc < n_chunks; ++cc) {
    const Chunk ch = chunk_at(x.plan, x.n_tokens, chunk0 + cc);
    cp_async_wait1();  // part A of this chunk (part B may still be in flight)
    __syncthreads();
    float decay[2][2];  // e^{G_last} of this warp's state rows, read before part A is overwritten
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      decay[mi][0] = reinterpret_cast<const float*>(r.part_a + kWsDecay)[32 * r.rt + 16 * mi + r.g];
      decay[mi][1] = reinterpret_cast<const float*>(r.part_a + kWsDecay)[32 * r.rt + 16 * mi + r.g + 8];
    }
    float vn[4][4] = {}, o[4][4] = {};
    rec_step_a(r, vn, o);
    __syncthreads();  // part A and S are read; v_new is complete
    if (cc + 1 < n_chunks) copy_part(smem_u32(smem + kRecSmemPartA), ws_of(chunk0 + cc + 1), kWsPartA);
    cp_async_commit();
    cp_async_wait1();  // part B of this chunk
    __syncthreads();
    rec_step_c(r, o, x, ch, h);
    rec_step_d(r, s, decay);
    __syncthreads();  // part B and v_new are read
    if (cc + 1 < n_chunks) copy_part(smem_u32(smem + kRecSmemPartB), ws_of(chunk0 + cc + 1) + kWsPartA, kWsPartBBytes);
    cp_async_commit();
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        store_split(r.s_hi, r.s_lo, 32 * r.rt + 16 * mi + r.g, 32 * r.cq + 8 * ni + 2 * r.t, s[mi][ni]);
      }
    }
  }
  rec_store_state(r, state, s);
}

void launch_tc(const TcArgs& x, int64_t n_seqs, cudaStream_t stream) {
  BG_CUDA_CHECK(
      cudaFuncSetAttribute(kda_tc_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPrepSmemBytes));
  BG_CUDA_CHECK(
      cudaFuncSetAttribute(kda_tc_recurrence_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRecSmemBytes));
  const dim3 grid1(static_cast<unsigned>(x.n_chunks), static_cast<unsigned>(x.n_heads));
  kda_tc_prepare_kernel<<<grid1, kPrepThreads, kPrepSmemBytes, stream>>>(x);
  BG_CUDA_CHECK_LAUNCH();
  const dim3 grid2(static_cast<unsigned>(n_seqs), static_cast<unsigned>(x.n_heads));
  kda_tc_recurrence_kernel<<<grid2, kRecurThreads, kRecSmemBytes, stream>>>(x);
  BG_CUDA_CHECK_LAUNCH();
}

bool tc_dims(const KdaParams& p) { return p.head_dim_k == kDim && p.head_dim_v == kDim; }

void check_common(const char* op, const KdaParams& p, const KdaCudaInputs& in, const __nv_bfloat16* out) {
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens <= std::numeric_limits<int32_t>::max(), "{}: n_tokens {} out of range", op,
           p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.n_heads <= 65535, "{}: n_heads {} out of range", op, p.n_heads);
  BG_CHECK(p.head_dim_k >= 1 && p.head_dim_k <= kKdaCudaMaxHeadDim && p.head_dim_v >= 1 &&
               p.head_dim_v <= kKdaCudaMaxHeadDim,
           "{}: head dims k={} v={} unsupported (each must be in [1, {}])", op, p.head_dim_k, p.head_dim_v,
           kKdaCudaMaxHeadDim);
  if (p.n_tokens == 0) return;
  BG_CHECK(in.q && in.k && in.v && in.g && in.beta && out, "{}: null input/output pointer with n_tokens {}", op,
           p.n_tokens);
  if (!tc_dims(p)) return;
  auto aligned = [](const void* ptr, uintptr_t n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; };
  BG_CHECK(aligned(in.q, 16) && aligned(in.k, 16) && aligned(in.v, 16) && aligned(out, 4),
           "{}: q / k / v must be 16-byte aligned and out 4-byte aligned (q {}, k {}, v {}, out {})", op,
           static_cast<const void*>(in.q), static_cast<const void*>(in.k), static_cast<const void*>(in.v),
           static_cast<const void*>(out));
}

void check_workspace(const char* op, const KdaWorkspace& ws, size_t need) {
  BG_CHECK(ws.ptr != nullptr && ws.bytes >= need, "{}: workspace of {} bytes at {} < the {} bytes needed", op, ws.bytes,
           ws.ptr, need);
  BG_CHECK(reinterpret_cast<uintptr_t>(ws.ptr) % 16 == 0, "{}: workspace {} not 16-byte aligned", op, ws.ptr);
}

}  // namespace

int64_t kda_chunk_count(int64_t n_tokens) { return (n_tokens + kChunk - 1) / kChunk; }

size_t kda_chunked_workspace_bytes(const KdaParams& p, int64_t n_chunks) {
  if (!tc_dims(p) || n_chunks <= 0) return 0;
  return static_cast<size_t>(n_chunks) * static_cast<size_t>(p.n_heads) * kWsBytes;
}

void kda_chunked_cuda(const KdaParams& p, const KdaCudaInputs& in, float* state, __nv_bfloat16* out, KdaWorkspace ws,
                      cudaStream_t stream) {
  constexpr const char* op = "kda_chunked_cuda";
  check_common(op, p, in, out);
  BG_CHECK(state != nullptr, "{}: state is null", op);
  if (p.n_tokens == 0) return;
  if (!tc_dims(p)) {
    kda_chunked_simt_cuda(p, in, state, out, stream);
    return;
  }
  const int64_t n_chunks = kda_chunk_count(p.n_tokens);
  check_workspace(op, ws, kda_chunked_workspace_bytes(p, n_chunks));
  TcArgs x{in,    out, static_cast<uint8_t*>(ws.ptr), nullptr, p.n_tokens, n_chunks,
           state, 0,   static_cast<int>(p.n_heads)};
  launch_tc(x, 1, stream);
}

void kda_chunked_varlen_cuda(const KdaParams& p, const KdaCudaInputs& in, const KdaVarlenBatch& batch,
                             __nv_bfloat16* out, KdaWorkspace ws, cudaStream_t stream) {
  constexpr const char* op = "kda_chunked_varlen_cuda";
  check_common(op, p, in, out);
  BG_CHECK(batch.plan != nullptr, "{}: no plan", op);
  const KdaVarlenPlan& plan = *batch.plan;
  if (plan.n_seqs() == 0) return;
  BG_CHECK(batch.state_base != nullptr, "{}: state_base is null", op);
  BG_CHECK(batch.slot_stride >= p.n_heads * p.head_dim_k * p.head_dim_v, "{}: slot_stride {} < one state of {} floats",
           op, batch.slot_stride, p.n_heads * p.head_dim_k * p.head_dim_v);
  const KdaChunkDesc& last = plan.chunks.back();
  BG_CHECK(static_cast<int64_t>(last.token_begin) + last.n_tokens <= p.n_tokens,
           "{}: the plan reaches token {} of {} rows", op, static_cast<int64_t>(last.token_begin) + last.n_tokens,
           p.n_tokens);
  BG_CHECK(plan.n_seqs() <= std::numeric_limits<int32_t>::max() && plan.n_chunks() <= (int64_t{1} << 31) - 1,
           "{}: {} sequences / {} chunks too many", op, plan.n_seqs(), plan.n_chunks());
  if (!tc_dims(p)) {
    // The CUDA-core kernel, one launch per sequence (the host plan has every offset).
    const int64_t qk = p.n_heads * p.head_dim_k, vd = p.n_heads * p.head_dim_v;
    for (const KdaSeqDesc& s : plan.seqs) {
      const KdaChunkDesc& first = plan.chunks[static_cast<size_t>(s.chunk_begin)];
      const KdaChunkDesc& end = plan.chunks[static_cast<size_t>(s.chunk_begin + s.n_chunks - 1)];
      const int64_t b = first.token_begin;
      KdaParams ps = p;
      ps.n_tokens = static_cast<int64_t>(end.token_begin) + end.n_tokens - b;
      const KdaCudaInputs sub{in.q + b * qk, in.k + b * qk, in.v + b * vd, in.g + b * qk, in.beta + b * p.n_heads};
      kda_chunked_simt_cuda(ps, sub, batch.state_base + s.slot * batch.slot_stride, out + b * vd, stream);
    }
    return;
  }
  BG_CHECK(batch.plan_dev != nullptr, "{}: the device copy of the plan is null", op);
  for (const KdaChunkDesc& c : plan.chunks) {
    BG_CHECK(c.n_tokens >= 1 && c.n_tokens <= kChunk, "{}: a chunk of {} tokens (plan chunk size must be {})", op,
             c.n_tokens, kChunk);
  }
  check_workspace(op, ws, kda_chunked_workspace_bytes(p, plan.n_chunks()));
  TcArgs x{in,
           out,
           static_cast<uint8_t*>(ws.ptr),
           batch.plan_dev,
           p.n_tokens,
           plan.n_chunks(),
           batch.state_base,
           batch.slot_stride,
           static_cast<int>(p.n_heads)};
  launch_tc(x, plan.n_seqs(), stream);
}

}  // namespace bg::ops

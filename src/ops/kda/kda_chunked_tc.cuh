// Chunked KDA prefill on tensor cores (K = V = 128), shared by its two kernels: a parallel "prepare" kernel over
// (chunk, head) (kda_chunked_tc_prepare.cu) and a recurrence kernel over (sequence, head) that carries the 128 x 128
// state through the chunks (kda_chunked_tc.cu, with the launchers kda_chunked_cuda / kda_chunked_varlen_cuda).
// This header holds the workspace layout both agree on and the PTX primitives; docs/KDA.md has the algorithm, the
// precision argument and the measured times.
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
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/elementwise/cuda_ptx.cuh"
#include "ops/kda/kda_cuda.h"

namespace bg::ops::kda_tc {

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
constexpr int kAStride = kChunk + 4;  // kernel 1 A, T [64, 68] fp32: rows 16-byte aligned for float4 reads

// ---- primitives ----------------------------------------------------------------------------------------------------

using ptx::cp_async16;  // (dst, src) and (dst, src, src_bytes): the rest zero-filled
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4_trans;
using ptx::smem_addr;

// d += a (16x16 row) * b (16x8 col), bf16 operands, fp32 accumulate.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  ptx::mma_bf16_16816(d, a, b0, b1);
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
// e^x by one ex2.approx.ftz: __expf's denormal handling (a compare and two multiplies around the MUFU) is not needed,
// since a factor below 2^-126 of a term that is at most 1 contributes nothing at the 2^-17 precision of the operands.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}
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

// Kernel 1 (kda_chunked_tc_prepare.cu): writes every (chunk, head)'s workspace; grid (n_chunks, n_heads).
void launch_prepare(const TcArgs& x, cudaStream_t stream);

}  // namespace bg::ops::kda_tc

// Device building blocks of the W4A16 expert kernel: cp.async (16 B, L2 only), bf16x2 multiply,
// mma.sync m16n8k16 (bf16 in, fp32 accumulate), the per-stage tensor-core step (16-byte shared loads straight into A
// and B fragment registers, E2M1 decode + E8M0 scale in registers), and the GLU. Included only by moe_w4a16_cuda.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops::w4 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Weights are read exactly once per step. An L2 evict-first hint (cp.async ... L2::cache_hint with a createpolicy
// operand) would keep activations, h, y and partials in L2 better, but nvcc 13.0's ptxas compiled it here into
// LDGSTS with an undefined, odd uniform descriptor register (desc[UR1]): an illegal instruction on the H200 (found
// with compute-sanitizer, 2026-12-01). Plain cp.async.cg (L2 only, L1 bypassed) until a fixed toolkit is checked.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// src_bytes 0 writes 16 zero bytes without reading (rows past the chunk, inputs past n_in).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Programmatic dependent launch: wait for the preceding grid to complete and flush (returns at once when this grid
// was not launched as a programmatic dependent), and allow the dependent grid to be scheduled.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// Round-to-nearest bf16x2 product; subnormal inputs are supported (PTX: no .ftz for bf16), which the E = 0 code needs.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// d += A (16x16, row) * B (16x8, col), bf16 inputs, fp32 accumulators (fragment layouts: moe_w4a16_layout.h).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Accumulators of one warp for a pass of NB n8 token blocks: [m16 tile][n8 block][c0..c3]. Sized by the pass, so a
// pass over fewer rows keeps (and moves) no unused accumulators.
template <int NB>
using Acc = float[kMTiles][NB][4];

// One pipeline stage of one warp: 64 inputs x (4 m16 tiles) x (NB n8 token blocks).
//   wbuf: the stage's 17408-byte weight block in shared memory; abuf: its activation tile (kActRowBytes rows).
// Per thread: 4 LDS.128 of codes (tile mt, words = k-steps), 1 LDS.64 of scales (8 E8M0' bytes: [mt][row half]),
// 2 NB LDS.128 of activations (chunks 2t, 2t+1 of tokens nb*8 + g). Per code word: 9 integer ops of decode, 4
// bf16x2 scale multiplies, NB mma.
template <int NB>
__device__ __forceinline__ void mma_stage(Acc<NB>& acc, const uint8_t* wbuf, const uint8_t* abuf, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  uint4 code[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) code[mt] = *reinterpret_cast<const uint4*>(wbuf + code_offset(warp, mt, lane));
  const uint2 sc = *reinterpret_cast<const uint2*>(wbuf + scale_offset(warp, g, t >> 1, 0, 0));
  uint4 bch[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int h = 0; h < 2; ++h) bch[nb][h] = *reinterpret_cast<const uint4*>(abuf + act_offset(nb * 8 + g, 2 * t + h));
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    uint32_t s_row_g, s_row_g8;
    tile_scales(sc.x, sc.y, mt, s_row_g, s_row_g8);
    const uint32_t words[4] = {code[mt].x, code[mt].y, code[mt].z, code[mt].w};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      uint32_t r[4];
      decode_word(words[ks], r);
      // Registers 0 and 2 hold row g, registers 1 and 3 row g + 8.
      const uint32_t a[4] = {mul_bf16x2(r[0], s_row_g), mul_bf16x2(r[1], s_row_g8), mul_bf16x2(r[2], s_row_g),
                             mul_bf16x2(r[3], s_row_g8)};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint4& ch = bch[nb][ks >> 1];
        mma_bf16_16816(acc[mt][nb], a, (ks & 1) ? ch.z : ch.x, (ks & 1) ? ch.w : ch.y);
      }
    }
  }
}

// The GLU, with the CPU reference's formulas (moe_w4a16_cpu.cpp): SwiGLU g sigmoid(g) u; SiTU
// [beta tanh(g / beta) sigmoid(g)] [beta_lin tanh(u / beta_lin)]. sigmoid via 1 / (1 + exp(-g)): exactly 0 once
// exp overflows. Out of line: the gate/up epilogue calls it up to 32 times per pass, and inlined copies (divisions,
// tanhf, expf each time) made that epilogue kilobytes of straight-line code that missed the instruction cache on
// every pass (Nsight Compute on the H200, 2026-12-04: a sixth to a quarter of the kernel's samples at 16-32 rows).
// Measured against a four-at-once variant (interleaved chains): this one is as fast at 16-32 rows and 7% faster at 1.
__device__ __noinline__ float glu(float g, float u, MoeW4a16Act act, float beta, float beta_lin) {
  if (act == MoeW4a16Act::kSwiGLU) return g / (1.0f + expf(-g)) * u;
  return beta * tanhf(g / beta) / (1.0f + expf(-g)) * (beta_lin * tanhf(u / beta_lin));
}

}  // namespace bg::ops::w4

// Device building blocks of the W4A16 expert kernel: cp.async (16 B, L2 only; 4 B for the wgmma activations; the
// shared primitives of ops/elementwise/cuda_ptx.cuh), bf16x2 multiply,
// mma.sync m16n8k16 (bf16 in, fp32 accumulate), the per-stage tensor-core step (16-byte shared loads straight into A
// and B fragment registers, E2M1 decode + E8M0 scale in registers), and the GLU. Included only by moe_w4a16_cuda.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/elementwise/cuda_ptx.cuh"
#include "ops/elementwise/wgmma_desc.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops::w4 {

using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::fence_operands;
using ptx::fence_proxy_async;
using ptx::smem_addr;
using ptx::wgmma_commit;
using ptx::wgmma_fence;
using ptx::wgmma_wait;

// Weights are read exactly once per step. An L2 evict-first hint (cp.async ... L2::cache_hint with a createpolicy
// operand) would keep activations, h, y and partials in L2 better, but nvcc 13.0's ptxas compiled it here into
// LDGSTS with an undefined, odd uniform descriptor register (desc[UR1]): an illegal instruction on the H200 (found
// with compute-sanitizer, 2026-12-01). Plain cp.async.cg (L2 only, L1 bypassed; ptx::cp_async16) until a fixed
// toolkit is checked.
using ptx::cp_async16;
// src_bytes 0 writes 16 zero bytes without reading (rows past the chunk, inputs past n_in).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, int src_bytes) {
  ptx::cp_async16(dst, src, static_cast<uint32_t>(src_bytes));
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

// d += A (16x16, row) * B (16x8, col) (ptx::mma_bf16_16816; fragment layouts: moe_w4a16_layout.h).
using ptx::mma_bf16_16816;

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

// ---- The wgmma path (MoeW4a16Params::wgmma, sm_90a) ---------------------------------------------------------------
// A from registers (each warp's m16 tile in mma.m16n8k16's A layout: warp w % 4 of a warpgroup supplies rows
// 16 (w % 4).. of the m64 operand and receives them in D, n8 block j in d[4 j..4 j + 3] as mma's C), B the
// activation tile in shared memory (K-major, 128-byte swizzle: act_sw128_offset), N = 8 NB tokens.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BG_W4_NO_WGMMA 1
#endif

// 4-byte cp.async (L1-allocating: .cg copies only 16 bytes); src_bytes 0 writes zeros without reading.
__device__ __forceinline__ void cp_async4_zfill(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// d[64 x 8 NB] = (scale_d ? d : 0) + A (registers) * B (descriptor), bf16 in, fp32 accumulate, B K-major. NB = 1..4:
// the decode passes (scale_d 1); 8, 16: the prefill kernel's N = 64 / 128 tiles, whose first k-step passes scale_d = 0
// instead of zeroing d with ordinary instructions (ptxas would then have to order them against the wgmmas in flight
// and serialise every wgmma of the kernel; docs/MLA_DECODE.md, C7515).
template <int NB>
__device__ __forceinline__ void wgmma_rs(float (&d)[NB * 4], const uint32_t (&a)[4], uint64_t b,
                                         uint32_t scale_d = 1u) {
#ifdef BG_W4_NO_WGMMA
  __trap();
#else
  if constexpr (NB == 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, "
        "p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
        : "memory");
  } else if constexpr (NB == 2) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, "
        "%9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
        : "memory");
  } else if constexpr (NB == 3) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11}, {%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
        : "memory");
  } else if constexpr (NB == 4) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
        : "memory");
  } else if constexpr (NB == 8) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
        "%27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
        : "memory");
  } else {
    static_assert(NB == 16, "1..4, 8 or 16 n8 blocks");
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
        "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
        "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
        "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
        "%63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
          "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
          "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
        : "memory");
  }
#endif
}

// mma_stage on wgmma: the same A registers (decode + scale), B from the swizzled activation tile at shared address
// `act`. Per k-step the four tiles' wgmmas are one commit group; k-step ks + 1 decodes into the other register set
// while ks's group runs (wait_group 1 before a set is rewritten), and the stage ends with every group done (the
// producer refills the buffers after the next barrier).
template <int NB>
__device__ __forceinline__ void wgmma_stage(Acc<NB>& acc, const uint8_t* wbuf, uint32_t act, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  uint4 code[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) code[mt] = *reinterpret_cast<const uint4*>(wbuf + code_offset(warp, mt, lane));
  const uint2 sc = *reinterpret_cast<const uint2*>(wbuf + scale_offset(warp, g, t >> 1, 0, 0));
  uint32_t s_row_g[kMTiles], s_row_g8[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) tile_scales(sc.x, sc.y, mt, s_row_g[mt], s_row_g8[mt]);
  const uint64_t b = wgmma::sw128_k_major_desc(act);  // K-major, 1024-byte atoms of 8 rows
  uint32_t a[2][kMTiles][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    uint32_t (&as)[kMTiles][4] = a[ks & 1];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const uint32_t word = ks == 0 ? code[mt].x : ks == 1 ? code[mt].y : ks == 2 ? code[mt].z : code[mt].w;
      uint32_t r[4];
      decode_word(word, r);
      as[mt][0] = mul_bf16x2(r[0], s_row_g[mt]);
      as[mt][1] = mul_bf16x2(r[1], s_row_g8[mt]);
      as[mt][2] = mul_bf16x2(r[2], s_row_g[mt]);
      as[mt][3] = mul_bf16x2(r[3], s_row_g8[mt]);
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) fence_operands(reinterpret_cast<float(&)[NB * 4]>(acc[mt]));
    wgmma_fence();  // the A registers (and, at ks 0, the accumulators) were written by ordinary instructions
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      // The k-step's 16 inputs start 32 bytes further into each 128-byte row (the descriptor's address >> 4).
      wgmma_rs<NB>(reinterpret_cast<float(&)[NB * 4]>(acc[mt]), as[mt], b + static_cast<uint64_t>(2 * ks));
    }
    wgmma_commit();
    if (ks < 3) {
      wgmma_wait<1>();  // k-step ks - 1's group is done: its register set may be rewritten next
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) fence_operands(a[(ks + 1) & 1][mt]);
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    fence_operands(a[0][mt]);
    fence_operands(a[1][mt]);
    fence_operands(reinterpret_cast<float(&)[NB * 4]>(acc[mt]));
  }
}

// The GLU, the CPU reference's formulas (moe_w4a16_cpu.cpp): SwiGLU g sigmoid(g) u; SiTU
// [beta tanh(g / beta) sigmoid(g)] [beta_lin tanh(u / beta_lin)]. The quotients through the hardware's approximate
// reciprocal and exp2 (__fdividef, __expf: a few ulp of fp32, far below the bf16 rounding of the result): the IEEE
// divisions, each with its range check and slow-path call, were half of the function's ~100 instructions, and the
// function a third of the prefill kernel's gate/up instructions (SASS on the H100, 2026-12-07). sigmoid is 0 once
// exp(-g) passes 2^126 (__fdividef's range), where the reference's is below 1e-38.
// Out of line: the gate/up epilogue calls it up to 64 times per pass, and inlined copies made that epilogue kilobytes
// of straight-line code that missed the instruction cache on every pass (Nsight Compute on the H200, 2026-12-04: a
// sixth to a quarter of the decode kernel's samples at 16-32 rows). Static: each kernel file that includes this
// header (decode, prefill) has its own copy.
static __device__ __noinline__ float glu(float g, float u, MoeW4a16Act act, float beta, float beta_lin) {
  const float sig = __fdividef(1.0f, 1.0f + __expf(-g));
  if (act == MoeW4a16Act::kSwiGLU) return g * sig * u;
  return beta * tanhf(__fdividef(g, beta)) * sig * (beta_lin * tanhf(__fdividef(u, beta_lin)));
}

}  // namespace bg::ops::w4

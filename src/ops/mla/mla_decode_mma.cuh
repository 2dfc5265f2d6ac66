// MLA decode attention: shared-memory layout, the PTX primitives (cp.async, ldmatrix, mma.sync, wgmma) and the two
// interchangeable tensor-core policies (MmaSync, Wgmma) that compute Sᵀ = tile · Qᵀ and Oᵀ += tileᵀ · Pᵀ.
//
// Orientation (heads are the MMA N dimension, so 48 heads per CTA are 6 n8 tiles / one n48 wgmma, never padded):
//   Q·Kᵀ:  Sᵀ[64 positions (M), Hc heads (N)] = tile[64, 576] (A, K-major) · Q[Hc, 576]ᵀ (B, K-major)
//   P·V:   Oᵀ[512 channels (M), Hc heads (N)] += tile[64, 0:512]ᵀ (A, M-major) · P[Hc, 64]ᵀ (B, K-major)
// Every operand lives in shared memory in the 128-byte-swizzle layout of the wgmma canonical "SW128" atoms: a
// [rows, cols] bf16 matrix is cut into slabs of 64 columns (128 B per row); row r of a slab sits at r * 128 B and its
// 16-byte chunk c at ((c ^ (r % 8)) * 16) (PTX ISA 9.7.15.5.1.2: K-major ((8,m),(T,2k)):((8T,SBO),(1,T)), M-major
// ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)), Swizzle<3,4,3>, atoms 1024-byte aligned). ldmatrix reads the same layout
// conflict-free (the 8 rows of an 8x8 matrix land in 8 different chunks), so both policies share the loaders.
//
// Accumulator layout (identical for both policies, PTX ISA "wgmma .m64nNk16 accumulator D" = mma.m16n8 C per warp):
// warp w (0..3) of a warpgroup owns rows 16w..16w+15; element d[4j + 2r + e] is row 16w + lane/4 + 8r, column
// 8j + 2 (lane % 4) + e.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/elementwise/cuda_ptx.cuh"
#include "ops/mla/mla_cuda.h"
#include "ops/mla/mla_decode_layout.h"

namespace bg::ops::mla_decode {

using namespace mla_layout;  // NOLINT: the layout formulas are this file's vocabulary

constexpr int kThreads = 256;  // two warpgroups
constexpr int kTile = 64;      // cache positions per tile
constexpr int kEntry = 576;    // bf16 per cache entry / per q_full row
constexpr int kLora = 512;     // latent channels (the P·V output)
constexpr int kChunks = kEntry / 8;          // 72 16-byte chunks per row
constexpr int kSlabs = kEntry / 64;          // 9 slabs of 64 columns
static_assert(kTileSlabBytes == kTile * 128 && kTileBytes == kSlabs * kTileSlabBytes, "tile layout");
static_assert(kKStepsPerWg * 2 * 16 == kEntry && kChannelsPerWg * 2 == kLora, "warpgroup split");

// Shared-memory layout of one CTA with kNT n8 head tiles (Hc = 8 kNT heads), byte offsets from a 1024-aligned base.
template <int kNT>
struct Smem {
  static constexpr int kHeads = kNT * 8;
  static constexpr int kQSlabBytes = kHeads * 128;
  static constexpr int kTiles = 0;                       // 2 x [64, 576] double-buffered cache tiles
  static constexpr int kQ = 2 * kTileBytes;              // [Hc, 576] absorbed query
  static constexpr int kP = kQ + kSlabs * kQSlabBytes;   // [Hc, 64] bf16 softmax numerators
  static constexpr int kXch = kP + kQSlabBytes;          // [2 wg][kNT/2 * 4][128] fp32 partial scores to exchange
  static constexpr int kRed = kXch + 2 * (kNT / 2) * 4 * 128 * 4;  // [2 wg][4 warps][Hc/2] fp32 per-warp reductions
  static constexpr int kAlpha = kRed + 2 * 4 * (kHeads / 2) * 4;   // [Hc] fp32 rescale of this tile
  static constexpr int kSum = kAlpha + kHeads * 4;                 // [Hc] fp32 softmax sums (segment end)
  static constexpr int kMax = kSum + kHeads * 4;                   // [Hc] fp32 running maxima (segment end)
  static constexpr int kBytes = kMax + kHeads * 4;
  static constexpr int kDynamicBytes = kBytes + 1024;  // slack to align the dynamic base to 1024
  static_assert(kQ % 1024 == 0 && kP % 1024 == 0 && kXch % 16 == 0, "SW128 atoms must be 1024-byte aligned");
  static_assert(kDynamicBytes <= 232448, "over the 227 KiB of shared memory a CTA may use");
};

// The shared PTX primitives (elementwise/cuda_ptx.cuh), under this namespace's names.
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::fence_operands;
using ptx::fence_proxy_async;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::smem_addr;
using ptx::wgmma_commit;
using ptx::wgmma_fence;
// Barrier over one warpgroup (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
}

// The calling thread's warpgroup (0, 1) and warp in it (0..3), read through a shuffle so the compiler knows they are
// warp-uniform: descriptors and shared-memory offsets built from them then stay in uniform registers.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }
__device__ __forceinline__ int warp_in_group() { return __shfl_sync(0xffffffffu, (threadIdx.x / 32) % 4, 0); }

// Largest token t with tile_prefix[t] <= tile (every token has at least one tile, so prefixes strictly increase).
__device__ __forceinline__ int64_t token_of_tile(const int32_t* prefix, int n_tokens, int64_t tile) {
  int lo = 0, hi = n_tokens - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The segments of partition g of a step's schedule (meta: MlaDecodeMeta), in order: f(t, tile_lo, tile_hi) for each
// token t whose tiles [tile_lo, tile_hi) (numbered within t) fall in the partition. The walk every attention kernel
// makes over its CTA's partition.
template <class F>
__device__ __forceinline__ void for_each_segment(const int32_t* meta, int n_tokens, int64_t g, F&& f) {
  const int32_t* prefix = meta + MlaDecodeMeta::kTilePrefix;
  const int32_t* part_begin = meta + MlaDecodeMeta::partition_begin(n_tokens);
  const int64_t end = part_begin[g + 1];
  int64_t tile = part_begin[g];
  for (int64_t t = token_of_tile(prefix, n_tokens, tile); tile < end; ++t) {
    const int64_t seg_end = min(end, static_cast<int64_t>(prefix[t + 1]));
    f(t, static_cast<int>(tile - prefix[t]), static_cast<int>(seg_end - prefix[t]));
    tile = seg_end;
  }
}

// Cache positions first..first+kRows-1 of one sequence into a swizzled tile of 9 slabs of kRows x 128 B (rows at or
// past n_ctx are zero-filled, so masked rows never feed NaN from stale memory into 0 * x): 64-position tiles of the
// heads-as-N kernels, 32-position halves of the heads-as-M one. Thread i copies chunks i % T + T j (T = 256 / kRows
// threads per row) of row i / T.
template <int kRows>
__device__ __forceinline__ void load_rows(uint32_t dst, const MlaPagedCache& cache, const int32_t* table,
                                          int block_size, int64_t first, int64_t n_ctx) {
  constexpr int kPerRow = kThreads / kRows;
  static_assert(kThreads % kRows == 0 && 8 % kPerRow == 0, "whole chunks per thread and slab");
  const int row = threadIdx.x / kPerRow, part = threadIdx.x % kPerRow;
  const int64_t pos = first + row;
  const __nv_bfloat16* src = cache.base;
  uint32_t bytes = 0;
  if (pos < n_ctx) {
    // No 64-bit division (a branching subroutine) and no __trap here: either makes ptxas serialise every wgmma
    // of the kernel (C7520). Positions are < 2^28 and inside the block table (the prep kernel checked them).
    // A negative entry (kMlaErrorBadBlock, raised by the prep kernel) reads as a zero row.
    const uint32_t p32 = static_cast<uint32_t>(pos), bs = static_cast<uint32_t>(block_size), blk = p32 / bs;
    const int32_t block = table[blk];
    src = block >= 0 ? cache.base + block * cache.block_stride + static_cast<int64_t>(p32 - blk * bs) * kEntry
                     : cache.base;
    bytes = block >= 0 ? 16u : 0u;
  }
  // Unrolled: every destination is one of kPerSlab per-thread bases plus a constant (load_rows_dst), every source
  // one base plus an immediate offset.
#pragma unroll
  for (int i = 0; i < kChunks / kPerRow; ++i) {
    const int c = part + kPerRow * i;
    cp_async16(dst + load_rows_dst(kRows, row, part, i), src + c * 8, bytes);  // bytes 0: nothing read
  }
}

// The group's query rows [Hc, 576] into the swizzled Q buffer; heads past n_valid (padding) are zero.
template <int kNT>
__device__ __forceinline__ void load_q(uint32_t dst, const __nv_bfloat16* rows, int n_valid) {
  constexpr int kHeads = kNT * 8;
  for (int idx = threadIdx.x; idx < kHeads * kChunks; idx += kThreads) {
    const int row = idx / kChunks, c = idx % kChunks;
    const bool valid = row < n_valid;
    cp_async16(dst + chunk_offset(row, c, Smem<kNT>::kQSlabBytes), valid ? rows + row * kEntry + c * 8 : rows,
               valid ? 16u : 0u);
  }
}

// d[0..3] += A (16x16, fragments a) * B (16x8, fragments b0 b1), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- mma.sync policy ----------------------------------------------------------------------------------------------

struct MmaSync {
  // s += tile[16w.., k] · Q[:, k]ᵀ over k-steps [k0, k0 + 18) for warp w of the calling warpgroup.
  template <int kNT>
  static __device__ __forceinline__ void qk(uint32_t tile, uint32_t q, int k0, float (&s)[kNT * 4]) {
    const int lane = threadIdx.x % 32, w = (threadIdx.x / 32) % 4;
#pragma unroll 1
    for (int kk = k0; kk < k0 + kKStepsPerWg; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, tile + qk_a_lane(lane, w, kk));
#pragma unroll
      for (int jp = 0; jp < kNT / 2; ++jp) {
        uint32_t b[4];
        ldmatrix_x4(b, q + qk_b_lane(lane, jp, kk, Smem<kNT>::kQSlabBytes));
        mma_bf16(&s[8 * jp], a, b[0], b[1]);
        mma_bf16(&s[8 * jp + 4], a, b[2], b[3]);
      }
    }
  }

  // o[c] += tile[:, ch]ᵀ · P[:, :]ᵀ for the channel rows 256 wg + 64c + 16w.. of warp w (c = 0..3).
  template <int kNT>
  static __device__ __forceinline__ void pv(uint32_t tile, uint32_t p, int wg, float (&o)[4][kNT * 4]) {
    const int lane = threadIdx.x % 32, w = (threadIdx.x / 32) % 4;
#pragma unroll
    for (int ks = 0; ks < kTile / 16; ++ks) {
      uint32_t b[kNT / 2][4];
#pragma unroll
      for (int jp = 0; jp < kNT / 2; ++jp) ldmatrix_x4(b[jp], p + pv_b_lane(lane, jp, ks));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, tile + pv_a_lane(lane, w, wg, c, ks));
#pragma unroll
        for (int jp = 0; jp < kNT / 2; ++jp) {
          mma_bf16(&o[c][8 * jp], a, b[jp][0], b[jp][1]);
          mma_bf16(&o[c][8 * jp + 4], a, b[jp][2], b[jp][3]);
        }
      }
    }
  }
};

// ---- wgmma policy (sm_90a) ---------------------------------------------------------------------------------------

__device__ __forceinline__ uint64_t desc_k_major(uint32_t start) { return sw128_desc(start, kKMajorLbo, kKMajorSbo); }
__device__ __forceinline__ uint64_t desc_m_major(uint32_t start) { return sw128_desc(start, kMMajorLbo, kMMajorSbo); }

__device__ __forceinline__ void wgmma_wait_all() { ptx::wgmma_wait<0>(); }

// d[64 x 8kNT] += A(desc a) · B(desc b), bf16 in, fp32 accumulate; kTransA = 1 reads A M-major. The build targets
// sm_90a only; any other device pass traps (the launcher never selects the wgmma policy there).
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BG_MLA_NO_WGMMA 1
#endif

template <int kTransA>
__device__ __forceinline__ void wgmma_n48(float (&d)[24], uint64_t a, uint64_t b) {
#ifdef BG_MLA_NO_WGMMA
  __trap();
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, p, 1, 1, %26, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
      : "l"(a), "l"(b), "n"(kTransA)
      : "memory");
#endif
}

template <int kTransA>
__device__ __forceinline__ void wgmma_n32(float (&d)[16], uint64_t a, uint64_t b) {
#ifdef BG_MLA_NO_WGMMA
  __trap();
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, %16, %17, p, 1, 1, %18, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "n"(kTransA)
      : "memory");
#endif
}

template <int kTransA>
__device__ __forceinline__ void wgmma_n16(float (&d)[8], uint64_t a, uint64_t b) {
#ifdef BG_MLA_NO_WGMMA
  __trap();
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %10, "
      "0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "n"(kTransA)
      : "memory");
#endif
}

// d[64 x 64] += A[64 x 16] (registers, mma.sync A-fragment layout per warp) · B[16 x 64] (shared memory, N-major:
// imm-trans-b). The P·V of the prefill kernel and of the heads-as-M decode kernel.
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
#ifdef BG_MLA_NO_WGMMA
  __trap();
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, "
      "%34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
      : "memory");
#endif
}

template <int kNT, int kTransA>
__device__ __forceinline__ void wgmma_bf16(float (&d)[kNT * 4], uint64_t a, uint64_t b) {
  static_assert(kNT == 2 || kNT == 4 || kNT == 6, "heads per CTA: 16, 32 or 48");
  if constexpr (kNT == 6) {
    wgmma_n48<kTransA>(d, a, b);
  } else if constexpr (kNT == 4) {
    wgmma_n32<kTransA>(d, a, b);
  } else {
    wgmma_n16<kTransA>(d, a, b);
  }
}

// A SW128 descriptor as its two 32-bit words: the start address >> 4 (bits 0-13) and the leading byte offset in `lo`,
// the stride byte offset and the swizzle in `hi`. at(d, bytes) moves the start by `bytes` with one 32-bit add: the
// start field never carries (shared addresses stay below 256 KiB). Built once per call from a base address, so the
// k-steps' descriptors cost one add each instead of the full encoding.
struct DescWords {
  uint32_t lo, hi;
};
__device__ __forceinline__ DescWords desc_words(uint64_t d) {
  return {static_cast<uint32_t>(d), static_cast<uint32_t>(d >> 32)};
}
__device__ __forceinline__ uint64_t at(DescWords d, uint32_t offset_bytes) {
  return (static_cast<uint64_t>(d.hi) << 32) | (d.lo + (offset_bytes >> 4));
}

struct Wgmma {
  // Same contract as MmaSync::qk: the whole warpgroup issues 18 m64n(8kNT)k16 over its k-steps, then waits. The
  // warpgroup's k-steps are a template argument, so every descriptor is the base one plus a constant.
  template <int kNT>
  static __device__ __forceinline__ void qk(uint32_t tile, uint32_t q, int k0, float (&s)[kNT * 4]) {
    if (k0 == 0) {
      qk_steps<kNT, 0>(tile, q, s);
    } else {
      qk_steps<kNT, kKStepsPerWg>(tile, q, s);
    }
  }
  template <int kNT, int kK0>
  static __device__ __forceinline__ void qk_steps(uint32_t tile, uint32_t q, float (&s)[kNT * 4]) {
    constexpr int kQSlab = Smem<kNT>::kQSlabBytes;
    const DescWords a = desc_words(desc_k_major(tile)), b = desc_words(desc_k_major(q));
    fence_operands(s);
    wgmma_fence();  // s was zeroed by ordinary register writes
#pragma unroll
    for (int i = 0; i < kKStepsPerWg; ++i) {
      wgmma_bf16<kNT, 0>(s, at(a, qk_a_start(kK0 + i)), at(b, qk_b_start(kK0 + i, kQSlab)));
    }
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(s);
  }

  // Same contract as MmaSync::pv: A = the tile read M-major (channels contiguous), 16 positions = 2 rows of atoms
  // (2048 B) per k-step; B = P, K-major, 32 B per k-step. The warpgroup's channels are a template argument (as qk).
  template <int kNT>
  static __device__ __forceinline__ void pv(uint32_t tile, uint32_t p, int wg, float (&o)[4][kNT * 4]) {
    if (wg == 0) {
      pv_steps<kNT, 0>(tile, p, o);
    } else {
      pv_steps<kNT, 1>(tile, p, o);
    }
  }
  template <int kNT, int kWg>
  static __device__ __forceinline__ void pv_steps(uint32_t tile, uint32_t p, float (&o)[4][kNT * 4]) {
    const DescWords a = desc_words(desc_m_major(tile)), b = desc_words(desc_k_major(p));
#pragma unroll
    for (int c = 0; c < 4; ++c) fence_operands(o[c]);
    wgmma_fence();  // o was rescaled by ordinary register writes
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int ks = 0; ks < kTile / 16; ++ks) {
        wgmma_bf16<kNT, 1>(o[c], at(a, pv_a_start(kWg, c, ks)), at(b, pv_b_start(ks)));
      }
    }
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int c = 0; c < 4; ++c) fence_operands(o[c]);
  }
};

}  // namespace bg::ops::mla_decode

// MLA decode attention: every shared-memory layout and fragment index formula of the kernel, as host+device
// functions, so that mla_decode_layout_test.cpp can emulate ldmatrix / mma.sync / wgmma (per the PTX ISA) over the
// kernel's own arithmetic on the CPU. No CUDA types.
//
// Layouts (byte offsets from 1024-byte aligned buffers; "SW128" = the wgmma 128-byte swizzle: row r of a 64-column
// slab at r * 128, its 16-byte chunk c at (c ^ (r % 8)) * 16):
//   tile [64 positions, 576]: 9 slabs of 8192 B        Q [Hc heads, 576]: 9 slabs of Hc * 128 B
//   P [Hc heads, 64 positions]: one slab of Hc * 128 B
// Accumulators (mma.m16n8 C per warp = wgmma m64nN D): element i of lane `lane` in warp w (0..3) of a warpgroup is
// row 16w + lane/4 + 8 ((i/2) % 2), column 8 (i/4) + 2 (lane % 4) + i % 2.
#pragma once

#include <cstdint>

#include "ops/elementwise/wgmma_desc.h"
#include "ops/mla/mla_decode_plan.h"  // BG_MLA_HD

namespace bg::ops::mla_layout {

inline constexpr uint32_t kTileSlabBytes = 8192;  // 64 rows x 128 B
inline constexpr uint32_t kTileBytes = 9 * kTileSlabBytes;
inline constexpr int kKStepsPerWg = 18;      // Q·Kᵀ: warpgroup g takes k16 steps [18g, 18g + 18) of 36
inline constexpr int kChannelsPerWg = 256;  // P·V: warpgroup g owns latent channels [256g, 256g + 256)

// wgmma descriptor strides (PTX ISA 9.7.15.5.1.2): K-major as ops/elementwise/wgmma_desc.h; M-major SW128 puts
// 64-element blocks along M `lbo` apart (a whole slab; unused at M = 64) and 8-row groups along K 1024 B apart.
using wgmma::kKMajorLbo;
using wgmma::kKMajorSbo;
using wgmma::sw128_desc;
inline constexpr uint32_t kMMajorLbo = kTileSlabBytes, kMMajorSbo = 1024;

BG_MLA_HD uint32_t sw128(uint32_t row, uint32_t chunk) { return row * 128u + ((chunk ^ (row & 7u)) << 4); }

// 16-byte chunk c (0..71, columns 8c..8c+7) of row `row` of a [rows, 576] matrix stored as 9 slabs.
BG_MLA_HD uint32_t chunk_offset(uint32_t row, uint32_t c, uint32_t slab_bytes) {
  return (c / 8) * slab_bytes + sw128(row, c % 8);
}

// Tile loaders (load_rows in mla_decode_mma.cuh): a tile of `rows` rows is copied by 256 threads, `256 / rows` per
// row; thread part `part` of row `row` copies chunks c = part + (256 / rows) i, i = 0..72 rows / 256 - 1. The
// destination of its copy i, written so that it is one of 8 / (256 / rows) per-thread bases plus a constant (equal to
// chunk_offset(row, c, rows * 128): MlaDecodeLayout.TileLoaderDestinationsAreTheChunkOffsets).
BG_MLA_HD uint32_t load_rows_dst(uint32_t rows, uint32_t row, uint32_t part, uint32_t i) {
  const uint32_t per_row = 256 / rows, per_slab = 8 / per_row;
  return (i / per_slab) * (rows * 128) + sw128(row, part + per_row * (i % per_slab));
}

// P element (head, position).
BG_MLA_HD uint32_t p_offset(uint32_t head, uint32_t pos) { return sw128(head, pos / 8) + (pos % 8) * 2; }

// ---- mma.sync: the row address each lane hands to ldmatrix.x4 -------------------------------------------------
// Matrix i = lane / 8 of the x4 covers fragment register i; lane % 8 is the row inside that 8x8 matrix.

// A of Q·Kᵀ (tile rows 16w.., K-major), k16 step kk: matrix i = (rows +8 if i odd, columns +8 if i >= 2) = a0..a3.
BG_MLA_HD uint32_t qk_a_lane(int lane, int w, int kk) {
  const int row = 16 * w + lane % 8 + ((lane / 8) % 2) * 8;
  return (kk / 4) * kTileSlabBytes + sw128(row, (kk % 4) * 2 + lane / 16);
}
// B of Q·Kᵀ for n8 tiles 2jp, 2jp+1 (Q rows = heads, K-major): matrix i = (tile 2jp + i/2, columns +8 if i odd).
BG_MLA_HD uint32_t qk_b_lane(int lane, int jp, int kk, uint32_t q_slab_bytes) {
  const int head = 16 * jp + lane % 8 + (lane / 16) * 8;
  return (kk / 4) * q_slab_bytes + sw128(head, (kk % 4) * 2 + (lane / 8) % 2);
}
// A of P·V read transposed (.trans) from the tile [position][channel]: rows = channels 256wg + 64c + 16w..,
// k = positions 16ks..; matrix i = (channels +8 if i odd, positions +8 if i >= 2).
BG_MLA_HD uint32_t pv_a_lane(int lane, int w, int wg, int c, int ks) {
  const int ch0 = kChannelsPerWg * wg + 64 * c + 16 * w;
  const int pos = 16 * ks + lane % 8 + (lane / 16) * 8;
  return (ch0 / 64) * kTileSlabBytes + sw128(pos, (ch0 % 64) / 8 + (lane / 8) % 2);
}
// B of P·V for n8 tiles 2jp, 2jp+1 (P rows = heads, K = positions): as qk_b_lane.
BG_MLA_HD uint32_t pv_b_lane(int lane, int jp, int ks) {
  const int head = 16 * jp + lane % 8 + (lane / 16) * 8;
  return sw128(head, 2 * ks + (lane / 8) % 2);
}

// ---- wgmma: descriptor start offsets (16 bf16 = 32 B along K inside a 128-byte row) -----------------------------
BG_MLA_HD uint32_t qk_a_start(int kk) { return (kk / 4) * kTileSlabBytes + (kk % 4) * 32; }
BG_MLA_HD uint32_t qk_b_start(int kk, uint32_t q_slab_bytes) { return (kk / 4) * q_slab_bytes + (kk % 4) * 32; }
// M-major A of P·V: channel slab 4wg + c, positions 16ks.. = two 8-row atoms (2048 B) per k-step.
BG_MLA_HD uint32_t pv_a_start(int wg, int c, int ks) { return (4 * wg + c) * kTileSlabBytes + ks * 2048; }
BG_MLA_HD uint32_t pv_b_start(int ks) { return ks * 32; }


// ---- heads as M (MlaDecodeMma::kWgmmaHeadsM, mla_decode_heads_m.cu) ------------------------------------------------
// Q·Kᵀ: S[64 head rows, 32 positions] = Q (A, K-major, slabs of Hc · 128 B: rows Hc..63 of the m64 operand read the
// next slab's first rows, or the zero pad after the last slab: rows that never leave the CTA) · a half tile (B,
// K-major, 32 positions = 9 slabs of 4096 B). P·V: O[64 head rows, 64 channels of block cb] += P (registers: the S
// accumulators as the A fragments) · V (B, MN-major: channels contiguous, `kHmPvLbo` between 64-channel slabs,
// 8-position groups 1024 B apart).
inline constexpr uint32_t kHalfTile = 32;                     // positions per ring buffer
inline constexpr uint32_t kHalfSlabBytes = kHalfTile * 128;   // 4096
inline constexpr uint32_t kHalfTileBytes = 9 * kHalfSlabBytes;
inline constexpr uint32_t kHmPvLbo = kHalfSlabBytes, kHmPvSbo = 1024;
BG_MLA_HD uint32_t hm_qk_a_start(int kk, uint32_t q_slab_bytes) { return (kk / 4) * q_slab_bytes + (kk % 4) * 32; }
BG_MLA_HD uint32_t hm_qk_b_start(int kk) { return (kk / 4) * kHalfSlabBytes + (kk % 4) * 32; }
// Warpgroup wg's channel block cb (channels 256 wg + 64 cb ..), positions 16 kk .. 16 kk + 15.
BG_MLA_HD uint32_t hm_pv_b_start(int wg, int cb, int kk) { return (4 * wg + cb) * kHalfSlabBytes + kk * 2048; }
// A register `reg` (0..3) of P·V k-step kk packs S accumulator elements hm_p_src(kk, reg) (low half) and + 1: the
// m64nNk16 A fragment (mma.m16n8k16's A per warp: a0 row g cols 2t.., a1 row g+8, a2 row g cols 2t+8.., a3 row g+8)
// is the accumulator of n8 blocks 2 kk and 2 kk + 1.
BG_MLA_HD int hm_p_src(int kk, int reg) { return 4 * (2 * kk + reg / 2) + 2 * (reg % 2); }

// ---- accumulators -------------------------------------------------------------------------------------------------
BG_MLA_HD int acc_row(int lane, int w, int i) { return 16 * w + lane / 4 + 8 * ((i / 2) % 2); }
BG_MLA_HD int acc_col(int lane, int i) { return 8 * (i / 4) + 2 * (lane % 4) + i % 2; }
// P·V accumulator row `row` (acc_row) of m64 chunk c of warpgroup wg is latent channel:
BG_MLA_HD int pv_channel(int wg, int c, int row) { return kChannelsPerWg * wg + 64 * c + row; }

}  // namespace bg::ops::mla_layout

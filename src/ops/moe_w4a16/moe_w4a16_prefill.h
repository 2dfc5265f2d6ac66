// Geometry, work decomposition and index maps of the W4A16 prefill kernel (moe_w4a16_prefill_cuda.cu), shared word
// for word by the kernel and the host tests that walk its schedule and emulate its shared-memory images
// (moe_w4a16_prefill_test.cpp). The weights are the decode kernel's layout (moe_w4a16_layout.h), read in another
// order: a tile is one half of a 512-row work item (m16 tiles 2h and 2h + 1 of every warp: for gate/up the gate and
// up rows of the same intermediate columns) times up to 128 of one expert's rows. Plain integer code: compiles as host
// C++ and as CUDA device code.
#pragma once

#include <cstdint>

#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops::w4p {

// ---- Geometry ------------------------------------------------------------------------------------------------------
inline constexpr int kTileRows = 128;                                 // an expert's rows per tile: wgmma's N at most
inline constexpr int kHalves = 2;                                     // half items per 512-row item
inline constexpr int kHalfMTiles = w4::kMTiles / kHalves;             // m16 tiles per warp in a half: 2
inline constexpr int kHalfWarpCodeBytes = kHalfMTiles * w4::kTileBytes;  // 1024
inline constexpr int kHalfCodeBytes = w4::kWarps * kHalfWarpCodeBytes;   // 8192: 256 rows x 64 k / 2
inline constexpr int kActBytes = kTileRows * w4::kActSw128RowBytes;      // 16384: 128 rows x 64 inputs, bf16
// A pipeline buffer: the activation tile first (a 128-byte-swizzle wgmma operand: 1024-byte aligned), then the
// half's codes (compacted: [warp][tile of the half][lane][16 B]), then the stage's 1024 bytes of scales (all four
// tiles', as stored: the consumer reads its half's bytes with the decode kernel's scale_offset).
inline constexpr int kBufCodes = kActBytes;
inline constexpr int kBufScales = kActBytes + kHalfCodeBytes;
inline constexpr int kBufBytes = kBufScales + w4::kScaleBytes;  // 25600 = 25 KiB
inline constexpr int kStages = 6;                                // 150 KiB of buffers, 4 stages in flight
inline constexpr int kCodeCopies = kHalfCodeBytes / 16;          // 512 16-byte copies per stage: 2 per thread
inline constexpr int kScaleCopies = w4::kScaleBytes / 16;        // 64
inline constexpr int kRowsPerWarp = kTileRows / w4::kWarps;      // 16 activation rows copied by each warp
inline constexpr int kMaxExperts = 1024;                         // touched experts a launch can plan (one CTA)
static_assert(kBufBytes % 1024 == 0, "every buffer's activation tile stays 1024-byte aligned");

// ---- The ring ------------------------------------------------------------------------------------------------------
// A CTA's s-th stage (counted over all its tiles) is read from buffer s % kStages. The prologue issues stages 0 ..
// kLoadAhead - 1; at stage s, after the stage's barrier, stage s + kLoadAhead is issued into refill_buffer(s %
// kStages), the buffer stage s - 2 was read from: each k-step waits for the wgmma group before its own, so the last
// group reading stage s - 2 was waited for during stage s - 1, before every warpgroup reached this barrier. One
// cp.async group per issued stage (empty once nothing is left), so at stage s stages up to s + kLoadAhead - 1 are
// committed and wait_group(kCpAsyncPending) leaves stage s landed.
inline constexpr int kLoadAhead = kStages - 2;
inline constexpr int kCpAsyncPending = kLoadAhead - 1;
BG_W4_HD int refill_buffer(int buf) { return buf >= 2 ? buf - 2 : buf + kStages - 2; }
static_assert(kCodeCopies == 2 * w4::kThreads, "two code copies per thread");

// ---- Shared-memory images ------------------------------------------------------------------------------------------
// Code copy i (0..511) of a stage reads 16 bytes at half_code_src(half, i) of the stage block and writes them at
// buffer codes + 16 i. The consumer's lane reads tile mt' (0, 1) of its half at half_code_offset(warp, mt', lane),
// which holds what the decode kernel reads at w4::code_offset(warp, 2 half + mt', lane).
BG_W4_HD int half_code_src(int half, int i) {
  return (i >> 6) * w4::kWarpCodeBytes + half * kHalfWarpCodeBytes + (i & 63) * 16;
}
BG_W4_HD int half_code_offset(int warp, int mtp, int lane) {
  return warp * kHalfWarpCodeBytes + mtp * w4::kTileBytes + lane * 16;
}
// Activations: word l (inputs 2 l, 2 l + 1 of the stage) of the tile's row `row` goes where the weights' k permutation
// puts it in the swizzled tile (w4::act_sw128_offset: source chunk l / 4, word l % 4).
BG_W4_HD int act_copy_offset(int row, int word) { return w4::act_sw128_offset(row, word >> 2, word & 3); }

// The permuted activation layout the kernel reads (x permuted once per call by moe_w4a16_permute_rows, h written so by
// the gate/up epilogue): each row padded with zeros to whole 64-input stages, and within a stage input c stored at
// permuted_col(c), so that permuted 16-byte chunk j is exactly what act_sw128_offset puts in chunk slot j of the
// swizzled tile. A stage's row is then eight 16-byte copies: chunk j of row `row` to act_chunk_offset(row, j).
// Source chunk ch (inputs 8 ch .. 8 ch + 7), word i of it, lands in chunk 4 (ch % 2) + i, word ch / 2.
BG_W4_HD int permuted_col(int col) {
  const int stage = col & ~63, c = col & 63, ch = c >> 3, i = (c >> 1) & 3;
  return stage + 8 * (4 * (ch & 1) + i) + 2 * (ch >> 1) + (c & 1);
}
// The inverse: the input stored at permuted position pc.
BG_W4_HD int unpermuted_col(int pc) {
  const int stage = pc & ~63, p = pc & 63, j = p >> 3, w = (p >> 1) & 3;
  return stage + 8 * (2 * w + (j >> 2)) + 2 * (j & 3) + (p & 1);
}
BG_W4_HD int act_chunk_offset(int row, int chunk) {
  return row * w4::kActSw128RowBytes + ((chunk ^ (row & 7)) << 4);
}
// Padded width of a permuted row of n inputs: whole stages.
BG_W4_HD int64_t permuted_width(int64_t n) { return (n + w4::kKStage - 1) / w4::kKStage * w4::kKStage; }

// ---- Tiles ---------------------------------------------------------------------------------------------------------
// wgmma's N for a tile of `rows` rows: 32, 64 or 128, the fewest covering them (an expert's last tile is usually
// partial; N = 128 on 36 rows would waste 72 % of its MMA work).
BG_W4_HD int tile_n(int rows) { return rows <= 32 ? 32 : rows <= 64 ? 64 : kTileRows; }
BG_W4_HD int token_tiles(int rows) { return static_cast<int>(w4::ceil_div(rows, kTileRows)); }
// Of the 16 activation rows warp w copies for a tile of `rows` rows: how many hold data (the rest it zero-fills) and
// how many it writes at all (the rows below the tile's N; wgmma reads no others).
BG_W4_HD int warp_data_rows(int rows, int warp) {
  const int left = rows - warp * kRowsPerWarp;
  return left < 0 ? 0 : left < kRowsPerWarp ? left : kRowsPerWarp;
}
BG_W4_HD int warp_copy_rows(int rows, int warp) { return warp_data_rows(tile_n(rows), warp); }

// A touched expert as the plan kernel records it for the main kernel: its block, its first permuted row and its row
// count (0 when its slot has no block: the plan flags that and the expert gets no tiles).
struct PrefillExpert {
  const uint8_t* block = nullptr;
  int32_t row0 = 0, rows = 0;
};

// Tile t of a launch: touched expert j (an index into the dispatch's active list), half item hm (item hm / 2, half
// hm % 2) and token tile tt. prefix[j] = the token tiles of touched experts 0..j-1 (prefix[0] = 0), so expert j owns
// tiles [halves prefix[j], halves prefix[j + 1]). Within an expert they go in bands of `band` token tiles (the last
// band may be narrower), each band half item major: the CTAs running at one time share a few half items' weights and
// a band's activation rows in L2 (one band holding all of an expert's token tiles reads every activation row once per
// half item, from DRAM when the expert's rows outgrow L2). `halves` = 2 n_items. 32-bit arithmetic (tiles < 2^31:
// moe_w4a16_prefill_check).
struct TilePos {
  int j = 0, hm = 0, tt = 0;
};
BG_W4_HD TilePos tile_pos(const int32_t* prefix, int n_active, int halves, int band, int t) {
  int lo = 0, hi = n_active - 1;  // the last j with halves * prefix[j] <= t (never an expert without tiles)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (halves * prefix[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  TilePos p;
  p.j = lo;
  const int within = t - halves * prefix[lo];
  const int tiles = prefix[lo + 1] - prefix[lo];
  const int b = within / (band * halves);  // the band; all before it are full
  const int in_band = within - b * band * halves;
  const int width = tiles - b * band < band ? tiles - b * band : band;
  p.hm = in_band / width;
  p.tt = b * band + (in_band - p.hm * width);
  return p;
}
// Token tiles per band by default: 8 x 128 rows (at K3's 7168 inputs 14.7 MB of activations) beside the ~16 half
// items the other CTAs of an H100 / H200 run at the same time.
inline constexpr int kDefaultBand = 8;
BG_W4_HD int total_tiles(const int32_t* prefix, int n_active, int halves) { return halves * prefix[n_active]; }

// ---- Results -------------------------------------------------------------------------------------------------------
// Accumulator i (0..3) of n8 block nb of tile mt' of warp `warp` (wgmma's D in mma.m16n8's C layout, rows of the
// warp's own m16 tile): its row of the tile (the permuted row within the tile) and its weight row.
BG_W4_HD int result_token(int lane, int nb, int i) { return nb * 8 + (lane & 3) * 2 + (i & 1); }
BG_W4_HD int result_r16(int lane, int i) { return (lane >> 2) + (i >> 1) * 8; }
// gate/up: the intermediate column of the gate (mt' 0) / up (mt' 1) pair; down: the output column.
BG_W4_HD int64_t gate_up_column(int item, int half, int warp, int r16) {
  return w4::gate_up_column(item, warp, 2 * half, r16);
}
BG_W4_HD int64_t down_column(int item, int half, int warp, int mtp, int r16) {
  return w4::down_row(item, warp, 2 * half + mtp, r16);
}

}  // namespace bg::ops::w4p

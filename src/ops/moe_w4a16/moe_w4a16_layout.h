// Index maps of the W4A16 expert layout (version kMoeW4a16LayoutVersion), shared word for word by the host builder and
// reader (moe_w4a16_layout.cpp), the CUDA kernel (moe_w4a16_cuda.cu) and the host fragment emulator in the tests, so
// the three cannot drift apart. Plain integer code: compiles as host C++ and as CUDA device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define BG_W4_HD __host__ __device__ __forceinline__
#else
#define BG_W4_HD inline
#endif

namespace bg::ops::w4 {

// ---- Geometry ------------------------------------------------------------------------------------------------------
// A CTA is 8 warps; warp w owns 4 m16 tiles (64 weight rows) of a 512-row work item and every k of a stage.
inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kMTiles = 4;                          // m16 tiles per warp
inline constexpr int kItemRows = kWarps * kMTiles * 16;    // 512 weight rows per work item
inline constexpr int kItemHCols = kItemRows / 2;           // gate/up: 256 intermediate columns per item
inline constexpr int kKStage = 64;                         // inputs per pipeline stage
inline constexpr int kTileBytes = 32 * 16;                 // one m16 x k64 tile: 32 lanes x 16 B
inline constexpr int kWarpCodeBytes = kMTiles * kTileBytes;            // 2048
inline constexpr int kCodeBytes = kWarps * kWarpCodeBytes;             // 16384 = 512 rows x 64 k / 2
inline constexpr int kWarpScaleBytes = 8 * 2 * kMTiles * 2;            // [g 8][q 2][mt 4][rh 2] = 128
inline constexpr int kScaleBytes = kWarps * kWarpScaleBytes;           // 1024 = 512 rows x 2 groups
inline constexpr int kStageBytes = kCodeBytes + kScaleBytes;           // 17408: one contiguous block per stage
inline constexpr int kChunkRows = 32;                      // rows (tokens) per pass over K: 4 n8 blocks
inline constexpr int kMaxNb = kChunkRows / 8;
inline constexpr int kActRowBytes = kKStage * 2 + 16;      // 144: +16 B pad makes B-fragment loads conflict-free
inline constexpr int kActStageBytes = kChunkRows * kActRowBytes;       // 4608
inline constexpr int kMaxSplits = 8;
inline constexpr int kCombineCols = kItemRows;             // down: output columns one item combines per token
inline constexpr int kMaxTopK = 32;                        // slots per token the fused combine takes

BG_W4_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- Which weight row a tile row holds ----------------------------------------------------------------------------
// gate/up: tiles alternate gate (even mt) and up (odd mt) over the same 16 intermediate columns, so a warp's
// accumulators for tiles 2p and 2p+1 hold gate and up of the same (column, token): the GLU needs no data exchange.
BG_W4_HD int64_t gate_up_column(int item, int warp, int mt, int r16) {
  return static_cast<int64_t>(item) * kItemHCols + warp * 32 + (mt >> 1) * 16 + r16;
}
BG_W4_HD bool gate_up_is_up(int mt) { return (mt & 1) != 0; }
BG_W4_HD int64_t down_row(int item, int warp, int mt, int r16) {
  return static_cast<int64_t>(item) * kItemRows + warp * (kMTiles * 16) + mt * 16 + r16;
}

// ---- Where a thread's bytes sit inside a stage block ---------------------------------------------------------------
// Codes: lane (g = lane / 4, t = lane % 4) of warp w reads 16 bytes per tile: word ks (0..3) is its A fragment for
// k-step ks. Consecutive lanes, consecutive 16 B: conflict-free LDS.128.
BG_W4_HD int code_offset(int warp, int mt, int lane) { return warp * kWarpCodeBytes + mt * kTileBytes + lane * 16; }
// Scales: byte (mt, rh) of the 8 bytes that lane (g, t) reads at scale_offset(w, g, t / 2, 0, 0): the E8M0' of row
// g + 8 rh of tile mt, group q = t / 2 of the stage (each thread's k all lie in one group, see stage_k).
BG_W4_HD int scale_offset(int warp, int g, int q, int mt, int rh) {
  return kCodeBytes + warp * kWarpScaleBytes + ((g * 2 + q) * kMTiles + mt) * 2 + rh;
}
// Activations (B operand) in shared memory: row (token) r of the chunk, 16-byte chunk c of its 64 stage inputs.
BG_W4_HD int act_offset(int row, int chunk16) { return row * kActRowBytes + chunk16 * 16; }

// ---- Activations for the wgmma path (MoeW4a16Params::wgmma) -------------------------------------------------------
// wgmma reads B (the tokens' activations) from shared memory in the canonical K-major 128-byte-swizzle layout: token
// row r of the stage at r * 128 (rows in 1024-byte atoms of 8, atoms 1024-byte aligned), and its 16-byte chunk j,
// the hardware k 8 j..8 j + 7 (k-step j / 2, half j % 2), at ((j ^ (r % 8)) * 16). The hardware k 16 ks + c is the
// stage input stage_k(t, ks, hi, e) for c = 2 t + 8 hi + e (the weights' permutation below, unchanged), so chunk
// j = 2 ks + hi holds in its word t the input pair 16 t + 4 ks + 2 hi: word i of the source chunk ch (inputs
// 8 ch..8 ch + 7) goes to word ch / 2 of chunk 4 (ch % 2) + i.
inline constexpr int kActSw128RowBytes = kKStage * 2;                     // 128
inline constexpr int kActSw128Bytes = kChunkRows * kActSw128RowBytes;     // 4096
BG_W4_HD int act_sw128_offset(int row, int src_chunk, int word) {
  const int j = 4 * (src_chunk & 1) + word;
  return row * kActSw128RowBytes + ((j ^ (row & 7)) << 4) + 4 * (src_chunk >> 1);
}

// ---- Fragment <-> k ------------------------------------------------------------------------------------------------
// PTX mma.m16n8k16 .bf16 (row.col), groupID g = lane >> 2, threadID_in_group t = lane & 3:
//   A register j (two bf16, element 2j low half): j=0 row g, col 2t+{0,1}; j=1 row g+8, col 2t+{0,1};
//                                                  j=2 row g, col 2t+8+{0,1}; j=3 row g+8, col 2t+8+{0,1}.
//   B register j: rows (k) 2t+8j+{0,1}, column (token) g.   C: c0,c1 row g cols 2t+{0,1}; c2,c3 row g+8.
// The mma's 16 k positions map to stage inputs by a permutation (applied to weights and activations alike, so the
// dot product is unchanged): thread t at k-step ks, column 2t + 8 hi + e  ->  input 16 t + 4 ks + 2 hi + e.
// Thread t thereby owns inputs [16 t, 16 t + 16) of the stage over its 4 k-steps: one MXFP4 group (q = t / 2) for
// its weights, and two 16-byte runs of each token's activations (chunks 2t, 2t+1) that load straight into B
// registers: chunk 2t + h, register pair (2 (ks & 1), 2 (ks & 1) + 1) for k-step ks = 2h + (ks & 1).
BG_W4_HD int stage_k(int t, int ks, int hi, int e) { return 16 * t + 4 * ks + 2 * hi + e; }
// Element i (0..7) of a code word = register i / 2, half i % 2: its row half (0: row g, 1: row g + 8) and k.
BG_W4_HD int element_row_half(int i) { return (i >> 1) & 1; }
BG_W4_HD int element_k(int t, int ks, int i) { return stage_k(t, ks, i >> 2, i & 1); }

// ---- E2M1 -> bf16 bits in registers ---------------------------------------------------------------------------------
// An E2M1 code SEEM placed in a bf16 lane as sign -> bit 15 and EEM -> bits 8..6 reads as value * 2^-126 (E = 0 gives
// the bf16 subnormal 0.5 * 2^-126, consistently). The stored word permutes its 32 bits so that the four A registers
// come out with one rotate and one mask each (three registers) or two of each (one register): 9 integer ops per 8
// weights. A word of 8 codes cannot give all four registers by a single rotate + mask (no 4 rotations of the target
// bit set tile 32 bits; checked exhaustively), so register 3 takes two parts.
inline constexpr uint32_t kLaneMask = 0x81C081C0u;  // bits 15, 8, 7, 6 of both halves
struct DecodePart {
  int rotl;
  uint32_t mask;
};
inline constexpr DecodePart kDecodeParts[4][2] = {
    {{0, kLaneMask}, {0, 0u}},
    {{4, kLaneMask}, {0, 0u}},
    {{10, kLaneMask}, {0, 0u}},
    {{6, 0x00400040u}, {14, 0x81808180u}},  // mantissa bits / sign + exponent bits
};
// Bit of a bf16 lane that carries code bit b (0: M, 1: E low, 2: E high, 3: sign).
inline constexpr int kCodeBitTarget[4] = {6, 7, 8, 15};

BG_W4_HD uint32_t rotl32(uint32_t x, int n) { return n == 0 ? x : (x << n) | (x >> (32 - n)); }

// The four A registers (value * 2^-126 each, before the scale) from one stored word.
BG_W4_HD void decode_word(uint32_t q, uint32_t (&r)[4]) {
  r[0] = q & kLaneMask;
  r[1] = rotl32(q, 4) & kLaneMask;
  r[2] = rotl32(q, 10) & kLaneMask;
  r[3] = (rotl32(q, 6) & 0x00400040u) | (rotl32(q, 14) & 0x81808180u);
}

// Position in the stored word of code bit b of element i (the encoder's inverse of decode_word).
BG_W4_HD constexpr int source_bit(int i, int b) {
  const int j = i >> 1, p = 16 * (i & 1) + kCodeBitTarget[b];
  for (int part = 0; part < 2; ++part) {
    if ((kDecodeParts[j][part].mask >> p) & 1u) return (p - kDecodeParts[j][part].rotl) & 31;
  }
  return -1;
}

// Stored scale byte s' (= s + 126 - shift) -> bf16x2 (2^(s'-127), 2^(s'-127)); s' = 0 gives 0 (underflow, see .cu).
BG_W4_HD uint32_t scale_bf16x2(uint32_t s_prime) { return s_prime * 0x00800080u; }

// The bf16x2 scale registers of rows g and g + 8 of tile mt, from the two words of E8M0' bytes a thread loads.
BG_W4_HD void tile_scales(uint32_t w_lo, uint32_t w_hi, int mt, uint32_t& s_row_g, uint32_t& s_row_g8) {
  const uint32_t sw = (mt < 2 ? w_lo : w_hi) >> (16 * (mt & 1));
  s_row_g = scale_bf16x2(sw & 0xffu);
  s_row_g8 = scale_bf16x2((sw >> 8) & 0xffu);
}

// ---- Work decomposition ----------------------------------------------------------------------------------------------
// Split-K factor for `base_items` (touched experts x items) over `grid` persistent CTAs. Cost of S, in item times:
// the waves of S * base items of 1/S the work, times (1 + the partial sums' traffic): each split writes and the last
// one reads 16 KiB per n8 block, against 17 KiB of weights per k-stage, so 2 S nb_cap / n_kstages. A larger S must win
// by 5%. Integer arithmetic, so the host (workspace sizing) and every CTA agree exactly.
BG_W4_HD int choose_splits(int64_t base_items, int n_kstages, int grid, int fixed, int nb_cap) {
  const int cap = n_kstages < kMaxSplits ? n_kstages : kMaxSplits;
  if (fixed > 0) return fixed < cap ? fixed : cap;
  if (base_items <= 0 || grid <= 0 || n_kstages <= 0) return 1;
  int best = 1;
  int64_t best_cost = ceil_div(base_items, grid) * 1000;
  for (int s = 2; s <= cap; ++s) {
    const int64_t waves = ceil_div(s * base_items, grid);
    const int64_t cost = waves * 1000 * (n_kstages + 2 * s * nb_cap) / (static_cast<int64_t>(s) * n_kstages);
    if (cost * 100 < best_cost * 95) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

// K-stages [begin, end) of split s of S over n stages (every split non-empty when S <= n).
BG_W4_HD int split_begin(int n_kstages, int splits, int s) {
  return n_kstages * s / splits;  // 32-bit: n_kstages <= 2^14 and s <= 8 (moe_w4a16_check_params)
}

}  // namespace bg::ops::w4

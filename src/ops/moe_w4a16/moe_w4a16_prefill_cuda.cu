// Grouped W4A16 MXFP4 expert FFN for prefill (rows, or the tokens through the dispatch's row_token, in; rows out): a
// persistent wgmma kernel with the weights dequantized in registers, run twice per layer (gate/up with the GLU fused,
// then down), after a one-CTA plan and a pass that permutes the inputs.
//
// Design
// - Why a second kernel: the decode kernel (moe_w4a16_cuda.cu) holds at most 32 rows per pass over an expert's
//   weights, so at prefill (hundreds to thousands of rows per expert) it decodes and streams every weight again per 32
//   rows; the dequantize-once path (ops/moe/moe_grouped*) writes the touched experts out as bf16 (84 MB per K3 expert)
//   and reads them back into cuBLAS. Here a weight is decoded once per 128 rows, into the A registers of a wgmma, and
//   never leaves the SM as bf16.
// - Operands: wgmma.m64nNk16, A = weights from registers (each warp its own m16 tile, decoded exactly as the decode
//   kernel's wgmma path does: E2M1 -> bf16 by bit placement, the E8M0 scale one bf16x2 multiply), B = the rows'
//   activations in shared memory (K-major, 128-byte swizzle, N = 128 rows; an expert's last tile takes N = 32 or 64
//   when it fits), fp32 accumulators. Same layout as the decode kernel (one copy of the weights).
// - Tile = half of a 512-row work item (m16 tiles 2h, 2h + 1 of each of the 8 warps: for gate/up the gate and up rows
//   of the same 16 intermediate columns, so the GLU needs no exchange) x up to 128 of one expert's rows; each
//   warpgroup issues two wgmmas per k-step (one per tile of the pair), 128 fp32 accumulators per thread at N = 128.
//   A tile runs the whole K (no split-K: thousands of tiles fill the GPU), so every output is one CTA's sum in a fixed
//   order: the same bits on every run.
// - Work list: the plan kernel (one CTA) records each touched expert (block, first row, rows) and the prefix of its
//   128-row tiles; each persistent CTA (grid = SM count) copies them into shared memory and takes tiles b, b + grid,
//   ..., ordered expert > band of 8 row tiles > half item > row tile, so the CTAs running at one time share a few
//   half items' weights and a band's rows in L2.
// - Activations: the weights' k permutation is applied to the activations once, outside the main loop: a pass copies
//   x (the tokens, or the rows) into the workspace with each 64-input stage permuted (w4p::permuted_col) and padded to
//   whole stages, and the gate/up epilogue writes h the same way, so a stage's row is eight 16-byte chunks that land
//   in the swizzled tile as they are (4-byte copies scattered by the permutation, the first version, cost ~500 of a
//   stage's ~700 instructions per warp and 63 % excess sectors).
// - Pipeline: 6 buffers of (16 KiB activations + 8 KiB codes + 1 KiB scales); every thread issues cp.async 4 stages
//   ahead, across tile boundaries: two 16-byte code copies, a scale copy (64 threads), and four 16-byte activation
//   copies (four rows of the warp's 16, one chunk of each, from row pointers resolved once per tile). One
//   __syncthreads per stage. The last wgmma group of a stage stays in flight across the
//   barrier (each k-step waits for the group before it only), which is why a buffer is refilled two stages after its
//   use and only 4 of the 6 stages are in flight.
// - Epilogues: gate/up: 2^shift, GLU (the decode kernel's w4::glu) on the fp32 accumulators, h in bf16 (permuted);
//   down: 2^shift, y in bf16. The weighted combine is the dispatch's (moe_combine_cuda), as for the other row paths.
//
// Performance model (H100/H200 SXM, 132 SMs, ~4096 dense bf16 FLOP per clock per SM)
// - Per stage and CTA at N = 128: 16 wgmma m64n128k16 = 4.2 MFLOP = 1024 tensor clocks at peak; loads 25 KiB
//   (~25 B/clock/SM: about 3-4 TB/s of L2 bandwidth over the GPU at peak, half of a bf16 128 x 256 GEMM tile's).
// - Issue per stage and thread: 2 words x 4 k-steps of decode (~13 instructions per word), 19 copies, 2 shared loads,
//   8 wgmma + fences: ~150, i.e. ~15 % of the issue slots at the tensor pipe's pace.
// - Waste: the last tile of an expert runs N = 32 / 64 / 128 for its rows (at 292 rows per expert: 128 + 128 + 64 for
//   292, 9 % of the MMA work wasted); the GLU epilogue (64 GLUs per thread per gate/up tile) runs with the tensor
//   cores idle. Measured (H100, 2026-12-07): with IEEE divisions in the GLU and a branch around each call it was
//   ~7.7k instructions per warp and tile against ~15k in the K loop, and gate/up took 3.1x the time of down for 2x
//   its FLOPs; the approximate quotients (w4::glu) and the predicated stores made the kernel 1.27x faster.
// Resources: see docs/MOE_PREFILL.md ("The W4A16 prefill kernel").
#include <algorithm>
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/moe_w4a16/moe_w4a16_device.cuh"
#include "ops/moe_w4a16/moe_w4a16_prefill.h"
#include "ops/moe_w4a16/moe_w4a16_prefill_cuda.h"

namespace bg::ops {
namespace {

using w4::kStageBytes;
using w4::kThreads;
using w4p::kBufBytes;
using w4p::kStages;
using w4p::kTileRows;
using bf16 = __nv_bfloat16;

// Everything a launch of one projection needs, by value (POD).
struct Args {
  int64_t proj_offset = 0;              // the projection's offset in an expert block
  int n_kstages = 0;                    // 64-input stages of one item
  int halves = 0;                       // half items: 2 n_items
  int band = w4p::kDefaultBand;         // token tiles per band of an expert's tiles (w4p::tile_pos)
  int n_in = 0, n_out = 0;              // activation width; output width (gate/up: inter; down: hidden)
  float out_scale = 1.0f;               // 2^scale_shift
  const bf16* act = nullptr;            // permuted rows (w4p::permuted_col): gate/up the rows or tokens, down h
  int64_t act_stride = 0;               // their padded width: w4p::permuted_width(n_in)
  const int32_t* row_token = nullptr;   // gather (gate/up only): row r reads act[row_token[r]]
  bf16* out = nullptr;                  // gate/up: h (permuted); down: y
  int64_t out_stride = 0;               // gate/up: permuted_width(inter); down: hidden
  const w4p::PrefillExpert* experts = nullptr;  // the plan: [n_active] records, [n_active + 1] tile prefix
  const int32_t* prefix = nullptr;
  const int32_t* n_active = nullptr;    // the dispatch's touched-expert count (device)
  MoeW4a16Act act_kind = MoeW4a16Act::kSwiGLU;
  float beta = 4.0f, beta_lin = 25.0f;
};

// ---- The plan ------------------------------------------------------------------------------------------------------
// One CTA of 1024 threads, thread j for touched expert j (n_active <= n_experts <= 1024: moe_w4a16_check_params):
// its record and the inclusive scan of the row tiles into prefix[j + 1].
__global__ void __launch_bounds__(w4p::kMaxExperts) prefill_plan_kernel(const MoeWorkspace d,
                                                                         const void* const* blocks,
                                                                         w4p::PrefillExpert* experts,
                                                                         int32_t* prefix) {
  __shared__ int32_t s_warp[w4p::kMaxExperts / 32];
  const int n_active = min(*d.n_active, w4p::kMaxExperts);
  const int j = static_cast<int>(threadIdx.x);
  int tiles = 0;
  if (j < n_active) {
    const int e = d.active[j];
    w4p::PrefillExpert rec;
    rec.block = static_cast<const uint8_t*>(blocks[e]);
    rec.row0 = d.offsets[e];
    rec.rows = d.offsets[e + 1] - rec.row0;
    if (rec.block == nullptr && rec.rows > 0) {  // a touched slot without weights: its rows are not computed
      atomicOr(d.error_flags, kMoeErrorBadDescriptor);
      rec.rows = 0;
    }
    experts[j] = rec;
    tiles = w4p::token_tiles(rec.rows);
  }
  int total = 0;
  const int before = cuda_util::block_exclusive_scan<w4p::kMaxExperts>(tiles, s_warp, &total);
  if (j < n_active) prefix[j + 1] = before + tiles;
  if (j == 0) prefix[0] = 0;
}

// ---- The producer --------------------------------------------------------------------------------------------------
// Its position (the tile and k-stage it issues next) and this thread's sources for that stage, set up when a tile
// starts and then stepped by one stage. The activations are permuted rows (w4p::permuted_col, padded with zeros to
// whole stages), so a stage's row is eight 16-byte chunks that go to their swizzled slots as they are. Warp w copies
// the tile's rows 16 w .. 16 w + 15: lane l the rows 16 w + 4 q + l / 8 (q = 0..3), chunk l % 8 of each (a warp
// instruction reads four whole 128-byte rows). The row pointers are resolved once per tile (with the gather, through
// row_token), so a stage's copy costs an add.
constexpr int kRowQuads = w4p::kRowsPerWarp / 4;  // rows per thread

struct Producer {
  int tile = 0;                 // >= the launch's tiles: nothing left to issue
  int ks = 0;
  int half = 0;
  const uint8_t* w = nullptr;   // the item's k-stage ks block
  const bf16* x[kRowQuads] = {};  // chunk lane % 8 of row 16 w + 4 q + lane / 8 at stage ks
  int rows = 0;                 // rows of the warp's 16 that hold data
  int nrows = 0;                // rows of the warp's 16 the consumer reads (past `rows`: zero-filled)
};

// What the CTA shares: the plan in shared memory and the launch's tile count.
struct Work {
  const w4p::PrefillExpert* experts;
  const int32_t* prefix;
  int n_active, total;
};

// The consumer's view of a tile.
struct TileInfo {
  int m = 0, half = 0;
  int64_t row0 = 0;  // the tile's first permuted row
  int rows = 0;      // 1..128
  int n = 0;         // wgmma's N: 32, 64 or 128
};

__device__ __forceinline__ TileInfo tile_info(const Work& wk, const Args& a, int tile) {
  const w4p::TilePos pos = w4p::tile_pos(wk.prefix, wk.n_active, a.halves, a.band, tile);
  const w4p::PrefillExpert e = wk.experts[pos.j];
  TileInfo t;
  t.m = pos.hm >> 1;
  t.half = pos.hm & 1;
  t.row0 = static_cast<int64_t>(e.row0) + pos.tt * kTileRows;
  t.rows = min(e.rows - pos.tt * kTileRows, kTileRows);
  t.n = w4p::tile_n(t.rows);
  return t;
}

template <bool kGather>
__device__ __forceinline__ void producer_start(Producer& p, const Work& wk, const Args& a, int tile) {
  p.tile = tile;
  if (tile >= wk.total) return;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const w4p::TilePos pos = w4p::tile_pos(wk.prefix, wk.n_active, a.halves, a.band, tile);
  const w4p::PrefillExpert e = wk.experts[pos.j];
  const int m = pos.hm >> 1;
  p.half = pos.hm & 1;
  p.ks = 0;
  p.w = e.block + a.proj_offset + static_cast<int64_t>(m) * a.n_kstages * kStageBytes;
  const int tile_rows = min(e.rows - pos.tt * kTileRows, kTileRows);
  p.rows = w4p::warp_data_rows(tile_rows, warp);
  p.nrows = w4p::warp_copy_rows(tile_rows, warp);
  const int64_t row0 = static_cast<int64_t>(e.row0) + pos.tt * kTileRows + warp * w4p::kRowsPerWarp + (lane >> 3);
#pragma unroll
  for (int q = 0; q < kRowQuads; ++q) {
    int64_t src_row = row0 + 4 * q;
    if constexpr (kGather) src_row = 4 * q + (lane >> 3) < p.rows ? a.row_token[src_row] : 0;
    p.x[q] = a.act + src_row * a.act_stride + 8 * (lane & 7);
  }
}

__device__ __forceinline__ void producer_issue(const Producer& p, const Args& a, uint8_t* buf) {
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const uint32_t base = ptx::smem_addr(buf);
#pragma unroll
  for (int i = 0; i < w4p::kCodeCopies / kThreads; ++i) {
    const int c = tid + i * kThreads;
    w4::cp_async16(base + w4p::kBufCodes + c * 16, p.w + w4p::half_code_src(p.half, c));
  }
  if (tid < w4p::kScaleCopies) w4::cp_async16(base + w4p::kBufScales + tid * 16, p.w + w4::kCodeBytes + tid * 16);
#pragma unroll
  for (int q = 0; q < kRowQuads; ++q) {
    const int r = 4 * q + (lane >> 3);
    if (r < p.nrows) {  // rows past the data: zeros (src_bytes 0 reads nothing)
      const bool data = r < p.rows;
      w4::cp_async16_zfill(base + w4p::act_chunk_offset(warp * w4p::kRowsPerWarp + r, lane & 7),
                           data ? p.x[q] : a.act, data ? 16 : 0);
    }
  }
}

template <bool kGather>
__device__ __forceinline__ void producer_next(Producer& p, const Work& wk, const Args& a) {
  if (++p.ks < a.n_kstages) {
    p.w += kStageBytes;
#pragma unroll
    for (int q = 0; q < kRowQuads; ++q) p.x[q] += w4::kKStage;
  } else {
    producer_start<kGather>(p, wk, a, p.tile + static_cast<int>(gridDim.x));
  }
}

// ---- The consumer --------------------------------------------------------------------------------------------------
// One stage of one warp: the two tiles of its half (A from the codes, decoded per k-step into one of two register
// sets), four k-steps of two wgmmas each, one commit group per k-step. Each k-step waits for the group before it
// only, so the set it decodes next is free and the stage's last group runs on past the stage (the producer refills
// a buffer two stages after its use). `first`: 0 on a tile's first stage (its first k-step overwrites the
// accumulators).
template <int NT>
__device__ __forceinline__ void stage_mma(float (&acc)[2][64], const uint8_t* buf, int half, uint32_t first, int warp,
                                          int lane) {
  const int g = lane >> 2, t = lane & 3;
  const uint4 c0 = *reinterpret_cast<const uint4*>(buf + w4p::kBufCodes + w4p::half_code_offset(warp, 0, lane));
  const uint4 c1 = *reinterpret_cast<const uint4*>(buf + w4p::kBufCodes + w4p::half_code_offset(warp, 1, lane));
  const uint2 sc = *reinterpret_cast<const uint2*>(buf + w4p::kBufScales +
                                                   (w4::scale_offset(warp, g, t >> 1, 0, 0) - w4::kCodeBytes));
  uint32_t s_g[2], s_g8[2];
  w4::tile_scales(sc.x, sc.y, 2 * half, s_g[0], s_g8[0]);
  w4::tile_scales(sc.x, sc.y, 2 * half + 1, s_g[1], s_g8[1]);
  const uint64_t b = wgmma::sw128_k_major_desc(ptx::smem_addr(buf));
  uint32_t a[2][2][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    uint32_t (&as)[2][4] = a[ks & 1];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint4& c = mt == 0 ? c0 : c1;
      const uint32_t word = ks == 0 ? c.x : ks == 1 ? c.y : ks == 2 ? c.z : c.w;
      uint32_t r[4];
      w4::decode_word(word, r);
      as[mt][0] = w4::mul_bf16x2(r[0], s_g[mt]);
      as[mt][1] = w4::mul_bf16x2(r[1], s_g8[mt]);
      as[mt][2] = w4::mul_bf16x2(r[2], s_g[mt]);
      as[mt][3] = w4::mul_bf16x2(r[3], s_g8[mt]);
    }
    ptx::fence_operands(acc[0]);
    ptx::fence_operands(acc[1]);
    ptx::wgmma_fence();  // the A registers were written by ordinary instructions
    const uint32_t scale_d = ks == 0 ? first : 1u;
    // The k-step's 16 inputs start 32 bytes further into each 128-byte row (the descriptor's address >> 4).
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      w4::wgmma_rs<NT>(reinterpret_cast<float(&)[NT * 4]>(acc[mt]), as[mt], b + static_cast<uint64_t>(2 * ks),
                        scale_d);
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<1>();  // the group before this one is done: its register set may be rewritten next
    ptx::fence_operands(a[(ks + 1) & 1][0]);
    ptx::fence_operands(a[(ks + 1) & 1][1]);
  }
}

// The epilogues walk this thread's results n8 block by n8 block with one running pointer: accumulator i of block nb
// is row 8 nb + 2 (lane % 4) + (i & 1) of the tile, weight row lane / 4 + 8 (i >> 1) of the warp's m16 tile. A tile's
// 16 weight rows are all inside the output or all past it (n_out is a multiple of 32, tiles start at multiples of 16).

// gate/up: h[row, col] = bf16(GLU(2^shift gate, 2^shift up)), tile 0 of the pair the gate, tile 1 the up rows, h in
// the permuted layout the down kernel reads (stride out_stride = permuted_width(inter); the columns past inter up to
// it written as zeros). The thread's columns col0 + lane / 4 and that + 8 sit at permuted_col(col0 + lane / 4) and 32
// after it (col0 is a multiple of 16). The GLU runs on every accumulator the tile's N wrote (the rows past the tile's
// data, from zero-filled activations, are computed and not stored) and only the store is predicated by the row: no
// branch around the call, whose convergence bookkeeping was a fifth of the epilogue's instructions (SASS on the H100,
// 2026-12-07). The decode kernel keeps its branch: at 1-8 rows of an n8 block most of the block is past the data.
__device__ void store_h(const float (&acc)[2][64], const TileInfo& ti, const Args& a, int warp, int lane) {
  const int64_t col0 = w4p::gate_up_column(ti.m, ti.half, warp, 0);
  if (col0 >= a.out_stride) return;
  const int t2 = (lane & 3) * 2;
  const int64_t stride = a.out_stride;
  bf16* row = a.out + (ti.row0 + t2) * stride + w4p::permuted_col(static_cast<int>(col0) + (lane >> 2));
  if (col0 >= a.n_out) {  // padding columns (warp-uniform): zeros
#pragma unroll 1
    for (int nb = 0; nb < 16; ++nb, row += 8 * stride) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (nb * 8 + t2 + (i & 1) < ti.rows) row[(i & 1) * stride + (i >> 1) * 32] = __float2bfloat16(0.0f);
      }
    }
    return;
  }
#pragma unroll
  for (int nb = 0; nb < 16; ++nb) {
    if (nb * 8 >= ti.n) break;  // CTA-uniform: the blocks past the tile's N were not written
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float v =
          w4::glu(acc[0][nb * 4 + i] * a.out_scale, acc[1][nb * 4 + i] * a.out_scale, a.act_kind, a.beta, a.beta_lin);
      if (nb * 8 + t2 + (i & 1) < ti.rows) row[(i & 1) * stride + (i >> 1) * 32] = __float2bfloat16(v);
    }
    row += 8 * stride;
  }
}

// down: y[row, col] = bf16(2^shift acc).
__device__ void store_y(const float (&acc)[2][64], const TileInfo& ti, const Args& a, int warp, int lane) {
  const int t2 = (lane & 3) * 2;
  const int64_t stride = a.n_out;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int64_t col0 = w4p::down_column(ti.m, ti.half, warp, mt, 0);
    if (col0 >= a.n_out) continue;
    bf16* row = a.out + (ti.row0 + t2) * stride + col0 + (lane >> 2);
#pragma unroll
    for (int nb = 0; nb < 16; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (nb * 8 + t2 + (i & 1) >= ti.rows) continue;
        row[(i & 1) * stride + (i >> 1) * 8] = __float2bfloat16(acc[mt][nb * 4 + i] * a.out_scale);
      }
      row += 8 * stride;
    }
  }
}

// One tile: every k-stage (the producer 4 stages ahead, across tiles), then the epilogue. The accumulators live here,
// sized by the tile's N.
template <bool kGateUp, bool kGather>
__device__ __forceinline__ void consume_tile(int& buf, Producer& p, const Work& wk, const Args& a, uint8_t* bufs,
                                             const TileInfo& ti) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  float acc[2][64];
#pragma unroll 1
  for (int s = 0; s < a.n_kstages; ++s) {
    ptx::cp_async_wait<w4p::kCpAsyncPending>();  // this thread's copies of stage `buf` landed
    ptx::fence_proxy_async();           // ... and are visible to wgmma's reads
    __syncthreads();  // everyone's did, and every group reading the buffer two stages back is done
    if (p.tile < wk.total) {
      producer_issue(p, a, bufs + w4p::refill_buffer(buf) * kBufBytes);
      producer_next<kGather>(p, wk, a);
    }
    ptx::cp_async_commit();
    const uint8_t* b = bufs + buf * kBufBytes;
    const uint32_t first = s == 0 ? 0u : 1u;
    if (ti.n == kTileRows) {
      stage_mma<16>(acc, b, ti.half, first, warp, lane);
    } else if (ti.n == 64) {
      stage_mma<8>(acc, b, ti.half, first, warp, lane);
    } else {
      stage_mma<4>(acc, b, ti.half, first, warp, lane);
    }
    buf = buf + 1 == kStages ? 0 : buf + 1;
  }
  ptx::wgmma_wait<0>();
  ptx::fence_operands(acc[0]);
  ptx::fence_operands(acc[1]);
  if constexpr (kGateUp) {
    store_h(acc, ti, a, warp, lane);
  } else {
    store_y(acc, ti, a, warp, lane);
  }
}

// kGather (gate/up only): the rows are gathered from the tokens through the dispatch's row_token inside the copies.
template <bool kGateUp, bool kGather>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(const __grid_constant__ Args a) {
  static_assert(kGateUp || !kGather, "down reads h in row order");
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* const bufs = smem + ((1024u - (ptx::smem_addr(smem) & 1023u)) & 1023u);
  const int n_active = min(*a.n_active, w4p::kMaxExperts);
  auto* s_experts = reinterpret_cast<w4p::PrefillExpert*>(bufs + kStages * kBufBytes);
  auto* s_prefix = reinterpret_cast<int32_t*>(s_experts + n_active);
  for (int j = static_cast<int>(threadIdx.x); j < n_active; j += kThreads) s_experts[j] = a.experts[j];
  for (int j = static_cast<int>(threadIdx.x); j <= n_active; j += kThreads) s_prefix[j] = a.prefix[j];
  __syncthreads();
  const Work wk{s_experts, s_prefix, n_active, n_active > 0 ? w4p::total_tiles(s_prefix, n_active, a.halves) : 0};
  const int grid = static_cast<int>(gridDim.x);
  if (static_cast<int>(blockIdx.x) >= wk.total) return;

  Producer p;
  producer_start<kGather>(p, wk, a, static_cast<int>(blockIdx.x));
#pragma unroll 1
  for (int i = 0; i < w4p::kLoadAhead; ++i) {  // the first stages into buffers 0, 1, ..., one commit group each
    if (p.tile < wk.total) {
      producer_issue(p, a, bufs + i * kBufBytes);
      producer_next<kGather>(p, wk, a);
    }
    ptx::cp_async_commit();
  }
  int buf = 0;
#pragma unroll 1
  for (int tile = static_cast<int>(blockIdx.x); tile < wk.total; tile += grid) {
    const TileInfo ti = tile_info(wk, a, tile);  // uniform across the CTA
    consume_tile<kGateUp, kGather>(buf, p, wk, a, bufs, ti);
  }
  ptx::cp_async_wait<0>();
}

int sm_count() {
  int dev = 0, n = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// The launch workspace: the plan's records, its prefix, then the permuted input rows.
struct WorkspaceOffsets {
  size_t prefix = 0, xq = 0, total = 0;
};
int64_t input_rows(const MoeW4a16Params& p, bool gather) { return gather ? p.n_tokens : p.n_tokens * p.top_k; }
WorkspaceOffsets workspace_offsets(const MoeW4a16Params& p, bool gather) {
  WorkspaceOffsets o;
  o.prefix = align256(static_cast<size_t>(p.n_experts) * sizeof(w4p::PrefillExpert));
  o.xq = o.prefix + align256(static_cast<size_t>(p.n_experts + 1) * sizeof(int32_t));
  o.total = o.xq + align256(static_cast<size_t>(input_rows(p, gather) * w4p::permuted_width(p.hidden)) * 2);
  return o;
}

// xq[r] = x[r] in the permuted layout (w4p::permuted_col), zero past n_in: thread i writes 16-byte chunk i % chunks of
// row i / chunks, gathering its eight inputs.
__global__ void permute_rows_kernel(const bf16* __restrict__ x, int64_t n_rows, int n_in, int64_t width,
                                    bf16* __restrict__ xq) {
  const int64_t chunks = width / 8, n = n_rows * chunks;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / chunks;
    const int pc0 = static_cast<int>(i - r * chunks) * 8;
    const bf16* src = x + r * n_in;
    union {
      uint4 raw;
      bf16 v[8];
    } out;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int c = w4p::unpermuted_col(pc0 + e);
      out.v[e] = c < n_in ? src[c] : __float2bfloat16(0.0f);
    }
    *reinterpret_cast<uint4*>(xq + r * width + pc0) = out.raw;
  }
}

// Dynamic shared memory: slack to align the buffers to 1024 bytes, the buffers, the plan of up to n_experts.
int smem_bytes(int64_t n_experts) {
  return 1024 + kStages * kBufBytes +
         static_cast<int>(n_experts * static_cast<int64_t>(sizeof(w4p::PrefillExpert)) + (n_experts + 1) * 4);
}

// Above the 48 KiB default: opt in (a host-side attribute, cheap, allowed while a stream is being captured).
template <bool kGateUp, bool kGather>
void launch_kernel(const Args& a, int grid, int smem, cudaStream_t stream) {
  BG_CUDA_CHECK(
      cudaFuncSetAttribute(prefill_kernel<kGateUp, kGather>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  prefill_kernel<kGateUp, kGather><<<grid, kThreads, smem, stream>>>(a);
  BG_CUDA_CHECK_LAUNCH();
}

Args projection_args(const MoeW4a16Params& p, const MoeW4a16MatrixInfo& m, const bf16* act, bf16* out,
                     int64_t out_stride, const w4p::PrefillExpert* experts, const int32_t* prefix,
                     const int32_t* n_active) {
  Args a;
  a.proj_offset = m.offset_bytes;
  a.n_kstages = static_cast<int>(m.n_kstages);
  a.halves = static_cast<int>(w4p::kHalves * m.n_items);
  static const int band = static_cast<int>(env_int("BG_MOE_PREFILL_BAND", 1, 4096).value_or(w4p::kDefaultBand));
  a.band = band;
  a.n_in = static_cast<int>(m.n_in);
  a.n_out = static_cast<int>(m.n_out);
  a.out_scale = std::ldexp(1.0f, m.scale_shift);
  a.act = act;
  a.act_stride = w4p::permuted_width(m.n_in);
  a.out = out;
  a.out_stride = out_stride;
  a.experts = experts;
  a.prefix = prefix;
  a.n_active = n_active;
  a.act_kind = p.act;
  a.beta = p.beta;
  a.beta_lin = p.beta_lin;
  return a;
}

}  // namespace

size_t moe_w4a16_prefill_workspace_bytes(const MoeW4a16Params& p, bool gather) {
  moe_w4a16_check_params(p);
  return workspace_offsets(p, gather).total;
}

int64_t moe_w4a16_prefill_h_width(const MoeW4a16Params& p) { return w4p::permuted_width(p.inter); }

void moe_w4a16_prefill_check(const MoeW4a16Params& p, const MoeW4a16Weights& w) {
  moe_w4a16_check_params(p);
  BG_CHECK(p.rows_out, "moe_w4a16_prefill: rows in, rows out only (MoeW4a16Params::rows_out: moe_w4a16_rows_params)");
  BG_CHECK(w.info.version == kMoeW4a16LayoutVersion, "moe_w4a16_prefill: weight layout version {} (this build runs {})",
           w.info.version, kMoeW4a16LayoutVersion);
  BG_CHECK(w.info.n_slots == p.n_experts && w.info.hidden == p.hidden && w.info.inter == p.inter,
           "moe_w4a16_prefill: weights hold {} experts {} -> {}, params say {} experts {} -> {}", w.info.n_slots,
           w.info.hidden, w.info.inter, p.n_experts, p.hidden, p.inter);
  // Tiles are counted in 32 bits: the most a launch can have (every row tile of the launch's rows, plus a partial
  // tile per expert, times the half items) must stay below 2^31.
  const int64_t halves = w4p::kHalves * std::max(w.info.gate_up.n_items, w.info.down.n_items);
  const int64_t tiles = halves * (w4::ceil_div(p.n_tokens * p.top_k, kTileRows) + p.n_experts);
  BG_CHECK(tiles < (int64_t{1} << 31), "moe_w4a16_prefill: {} tokens x top-{} over {} experts is too many tiles",
           p.n_tokens, p.top_k, p.n_experts);
}

void moe_w4a16_prefill_cuda(const MoeW4a16Params& p, const MoeW4a16Weights& w, const MoeWorkspace& d,
                            const MoeW4a16PrefillIo& io, cudaStream_t stream) {
  moe_w4a16_prefill_check(p, w);
  if (p.n_tokens == 0) return;
  BG_CHECK(w.blocks != nullptr && d.offsets && d.active && d.n_active && d.error_flags &&
               (!io.gather || d.row_token),
           "moe_w4a16_prefill: the block table and the dispatch's offsets, active list, count, error word (and with "
           "gather its row_token) must be set");
  BG_CHECK(io.x && io.h && io.y && cuda::aligned_to(io.x, 4) && cuda::aligned_to(io.h, 16) && cuda::aligned_to(io.y, 4),
           "moe_w4a16_prefill: x {} and y {} must be non-null and 4-byte aligned, h {} 16-byte aligned",
           static_cast<const void*>(io.x), static_cast<const void*>(io.y), static_cast<const void*>(io.h));
  BG_CHECK(io.workspace != nullptr && cuda::aligned_to(io.workspace, 256),
           "moe_w4a16_prefill: workspace {} must be non-null and 256-byte aligned", io.workspace);
  const WorkspaceOffsets o = workspace_offsets(p, io.gather);
  auto* experts = static_cast<w4p::PrefillExpert*>(io.workspace);
  auto* prefix = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(io.workspace) + o.prefix);
  auto* xq = reinterpret_cast<bf16*>(static_cast<uint8_t*>(io.workspace) + o.xq);
  prefill_plan_kernel<<<1, w4p::kMaxExperts, 0, stream>>>(d, w.blocks, experts, prefix);
  BG_CUDA_CHECK_LAUNCH();
  const int smem = smem_bytes(p.n_experts);
  int dev = 0, optin = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  BG_CHECK(smem <= optin, "moe_w4a16_prefill: {} experts need {} bytes of shared memory, the device allows {}",
           p.n_experts, smem, optin);
  const int grid = sm_count();
  const int64_t x_rows = input_rows(p, io.gather), x_width = w4p::permuted_width(p.hidden);
  permute_rows_kernel<<<cuda_util::elementwise_blocks(x_rows * x_width / 8, 256), 256, 0, stream>>>(
      io.x, x_rows, static_cast<int>(p.hidden), x_width, xq);
  BG_CUDA_CHECK_LAUNCH();
  Args gu = projection_args(p, w.info.gate_up, xq, io.h, moe_w4a16_prefill_h_width(p), experts, prefix, d.n_active);
  const Args dn = projection_args(p, w.info.down, io.h, io.y, p.hidden, experts, prefix, d.n_active);
  if (io.gather) {
    gu.row_token = d.row_token;
    launch_kernel<true, true>(gu, grid, smem, stream);
  } else {
    launch_kernel<true, false>(gu, grid, smem, stream);
  }
  launch_kernel<false, false>(dn, grid, smem, stream);
}

}  // namespace bg::ops

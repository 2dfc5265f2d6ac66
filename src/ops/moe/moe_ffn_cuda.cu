// Grouped expert FFN over the permuted rows, reading per-expert offsets on the device: gate/up -> GLU -> down.
// Skinny path (decode: few rows per expert): one block per (16 output rows, active expert), weights streamed once per
// 16 rows of the expert. Tiled path (prefill): one block per (64 output columns, 64-row tile of one expert), bf16
// tensor cores (WMMA 16x16x16, fp32 accumulate) with weight tiles dequantized into shared memory.


#include <mma.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe/moe_glu_device.cuh"
#include "ops/linear/linear_cuda_device.cuh"

namespace bg::ops {
namespace {

namespace dev = cudadev;

// Which projection a launch computes: gate+up with the GLU epilogue (-> h), or down (-> y_perm).
enum class Stage : uint8_t { kGateUp, kDown };

// Stage geometry shared by both paths: the weights of expert e, input and output of the stage.
template <Stage S>
struct StageIo {
  static constexpr int kMats = S == Stage::kGateUp ? 2 : 1;
  DeviceWeight w[kMats];
  const __nv_bfloat16* in;  // [n_slots, n_in]
  __nv_bfloat16* out;       // [n_slots, n_out]
  int64_t n_in, n_out;
};

// Loads slot e's descriptors. `ok` is false when they disagree with the launch's shape or format (a wrong expert
// table must not be read with the wrong stride): the error word gets kMoeErrorBadDescriptor and the caller's block
// writes nothing (a trap would poison the CUDA context).
template <Stage S, WeightFormat F>
__device__ StageIo<S> stage_io(const ExpertWeightsCuda* experts, int e, const MoeWorkspace& ws, int64_t hidden,
                               int64_t inter, bool& ok) {
  StageIo<S> io;
  if constexpr (S == Stage::kGateUp) {
    io.w[0] = experts[e].gate;
    io.w[1] = experts[e].up;
    io.in = ws.x_perm;
    io.out = ws.h;
    io.n_in = hidden;
    io.n_out = inter;
  } else {
    io.w[0] = experts[e].down;
    io.in = ws.h;
    io.out = ws.y_perm;
    io.n_in = inter;
    io.n_out = hidden;
  }
  ok = true;
#pragma unroll
  for (int m = 0; m < StageIo<S>::kMats; ++m) {
    if (io.w[m].format != F || io.w[m].n_in != io.n_in || io.w[m].n_out != io.n_out) ok = false;
  }
  if (!ok && threadIdx.x == 0) atomicOr(ws.error_flags, kMoeErrorBadDescriptor);
  return io;
}

// ---- Skinny path -------------------------------------------------------------------------------------------------

// grid (ceil(n_out / 16), max active experts): block (bx, j) computes rows [16 bx, 16 bx + 16) of active expert j for
// all of that expert's permuted rows, 16 at a time.
template <Stage S, WeightFormat F>
__global__ void __launch_bounds__(dev::kSkinnyThreads) moe_skinny_kernel(const ExpertWeightsCuda* experts,
                                                                        MoeWorkspace ws, int64_t hidden,
                                                                        int64_t inter, MoeGluParams act) {
  if (static_cast<int>(blockIdx.y) >= *ws.n_active) return;  // whole block
  const int e = ws.active[blockIdx.y];
  bool ok = false;
  const StageIo<S> io = stage_io<S, F>(experts, e, ws, hidden, inter, ok);
  if (!ok) return;  // whole block (the descriptor is the same for every thread)
  const int begin = ws.offsets[e], end = ws.offsets[e + 1];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * dev::kSkinnyRowsPerBlock;
  for (int r0 = begin; r0 < end; r0 += dev::kSkinnyTokens) {
    const int n_tok = min(dev::kSkinnyTokens, end - r0);
    dev::skinny_block<F, StageIo<S>::kMats>(
        io.w, io.in + static_cast<int64_t>(r0) * io.n_in, n_tok, row0,
        [&](int64_t col, int t, const float (&v)[StageIo<S>::kMats]) {
          float o;
          if constexpr (S == Stage::kGateUp) {
            o = moe_glu(v[0], v[1], act);
          } else {
            o = v[0];
          }
          io.out[static_cast<int64_t>(r0 + t) * io.n_out + col] = __float2bfloat16(o);
        });
  }
}

// ---- Tiled path --------------------------------------------------------------------------------------------------

constexpr int kTileM = kMoeTileRows;  // permuted rows per tile
constexpr int kTileN = 64;            // output columns per tile
constexpr int kTileK = 32;            // one MXFP4 group; four per FP8 block
constexpr int kLds = kTileK + 8;      // bf16 row stride in shared memory (padding against bank conflicts)
constexpr int kLdc = kTileN + 4;      // fp32 row stride of the epilogue tile
constexpr int kTiledThreads = 128;    // 4 warps, 2 x 2, each 32 x 32 of the tile

template <int kMats>
union TiledSmem {
  struct {
    __nv_bfloat16 a[kTileM][kLds];
    __nv_bfloat16 b[kMats][kTileN][kLds];
  } in;
  float c[kMats][kTileM][kLdc];
};

// A tile: rows [row_begin, row_begin + n_rows) of `in` (zeros past n_rows / n_in), columns k0 .. k0 + 32.
// Thread i loads row i / 2, 16 elements at k0 + 16 (i % 2).
__device__ __forceinline__ void load_a_tile(const __nv_bfloat16* in, int64_t n_in, int64_t row_begin, int n_rows,
                                            int64_t k0, __nv_bfloat16 (*a)[kLds]) {
  const int r = static_cast<int>(threadIdx.x) / 2, kk = (static_cast<int>(threadIdx.x) % 2) * 16;
  const int64_t k = k0 + kk;
  const __nv_bfloat16* src = in + (row_begin + r) * n_in + k;
  __align__(16) __nv_bfloat16 v[16];
  if (r < n_rows && n_in % 8 == 0 && k + 16 <= n_in) {
    *reinterpret_cast<uint4*>(v) = __ldg(reinterpret_cast<const uint4*>(src));
    *reinterpret_cast<uint4*>(v + 8) = __ldg(reinterpret_cast<const uint4*>(src) + 1);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = (r < n_rows && k + j < n_in) ? src[j] : __float2bfloat16(0.0f);
  }
  *reinterpret_cast<uint4*>(&a[r][kk]) = *reinterpret_cast<const uint4*>(v);
  *reinterpret_cast<uint4*>(&a[r][kk + 8]) = *reinterpret_cast<const uint4*>(v + 8);
}

// B tile: weight rows [n0, n0 + 64) (output columns), k0 .. k0 + 32, dequantized to bf16 (code * scale rounded once;
// exact for MXFP4 and bf16, within 2^-9 relative for FP8). Zeros past n_out / n_in.
template <WeightFormat F>
__device__ __forceinline__ void load_b_tile(const DeviceWeight& w, int64_t n0, int64_t k0, __nv_bfloat16 (*b)[kLds]) {
  const int r = static_cast<int>(threadIdx.x) / 2, kk = (static_cast<int>(threadIdx.x) % 2) * 16;
  __align__(16) __nv_bfloat16 v[16];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t k = k0 + kk + half * 8;
    float f[8];
    float s = 0.0f;
    if (n0 + r < w.n_out && k < w.n_in) {
      s = dev::load_weight8<F>(w, n0 + r, k, f);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) v[half * 8 + j] = __float2bfloat16(f[j] * s);
  }
  *reinterpret_cast<uint4*>(&b[r][kk]) = *reinterpret_cast<const uint4*>(v);
  *reinterpret_cast<uint4*>(&b[r][kk + 8]) = *reinterpret_cast<const uint4*>(v + 8);
}

// Expert owning global tile `tile`: the last e with tile_offsets[e] <= tile (empty experts own no tiles).
__device__ int expert_of_tile(const int32_t* tile_offsets, int n_experts, int tile) {
  int lo = 0, hi = n_experts;  // invariant: tile_offsets[lo] <= tile < tile_offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tile_offsets[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// grid (ceil(n_out / 64), upper bound of tiles): block (bx, tile) computes columns [64 bx, 64 bx + 64) of one 64-row
// tile of one expert; blocks past the device-side tile count exit.
template <Stage S, WeightFormat F>
__global__ void __launch_bounds__(kTiledThreads) moe_tiled_kernel(const ExpertWeightsCuda* experts, MoeWorkspace ws,
                                                                 int n_experts, int64_t hidden, int64_t inter,
                                                                 MoeGluParams act) {
  using namespace nvcuda;
  constexpr int kMats = StageIo<S>::kMats;
  __shared__ __align__(128) TiledSmem<kMats> sm;
  const int tile = static_cast<int>(blockIdx.y);
  if (tile >= ws.tile_offsets[n_experts]) return;  // whole block
  const int e = expert_of_tile(ws.tile_offsets, n_experts, tile);
  bool ok = false;
  const StageIo<S> io = stage_io<S, F>(experts, e, ws, hidden, inter, ok);
  if (!ok) return;  // whole block
  const int64_t row_begin = ws.offsets[e] + static_cast<int64_t>(tile - ws.tile_offsets[e]) * kTileM;
  const int n_rows = min(kTileM, static_cast<int>(ws.offsets[e + 1] - row_begin));
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTileN;
  const int warp = static_cast<int>(threadIdx.x) / 32, wm = (warp / 2) * 32, wn = (warp % 2) * 32;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats][2][2];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[m][i][j], 0.0f);

  for (int64_t k0 = 0; k0 < io.n_in; k0 += kTileK) {
    load_a_tile(io.in, io.n_in, row_begin, n_rows, k0, sm.in.a);
#pragma unroll
    for (int m = 0; m < kMats; ++m) load_b_tile<F>(io.w[m], n0, k0, sm.in.b[m]);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &sm.in.a[wm + 16 * i][kk], kLds);
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
        // b[n][k] is W's row n: as a K x N operand that is column-major with leading dimension kLds.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &sm.in.b[m][wn + 16 * j][kk], kLds);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[m][i][j], fa[i], fb[j], acc[m][i][j]);
      }
    }
    __syncthreads();  // the tiles are consumed (and the epilogue reuses the memory)
  }

#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&sm.c[m][wm + 16 * i][wn + 16 * j], acc[m][i][j], kLdc, wmma::mem_row_major);
  __syncthreads();
  for (int idx = static_cast<int>(threadIdx.x); idx < kTileM * kTileN; idx += kTiledThreads) {
    const int r = idx / kTileN, c = idx % kTileN;
    if (r >= n_rows || n0 + c >= io.n_out) continue;
    float o;
    if constexpr (S == Stage::kGateUp) {
      o = moe_glu(sm.c[0][r][c], sm.c[1][r][c], act);
    } else {
      o = sm.c[0][r][c];
    }
    io.out[(row_begin + r) * io.n_out + n0 + c] = __float2bfloat16(o);
  }
}

// ---- Launch ------------------------------------------------------------------------------------------------------

bool use_skinny(const MoeCudaParams& p) {
  if (p.path == MoeFfnPath::kSkinny) return true;
  if (p.path == MoeFfnPath::kTiled) return false;
  return p.shape.n_tokens <= kMoeSkinnyMaxTokens;
}

template <Stage S, WeightFormat F>
void launch_stage(const MoeCudaParams& p, const ExpertWeightsCuda* experts, const MoeWorkspace& ws,
                  cudaStream_t stream) {
  const int64_t slots = p.shape.n_pairs();
  const int64_t n_out = S == Stage::kGateUp ? p.inter : p.hidden;
  // Upper bounds known on the host: at most min(slots, pairs) slots have rows, and their tiles number at most
  // pairs / 64 plus one partial tile per active slot.
  const int64_t max_active = std::min(p.shape.n_slots, slots);
  if (use_skinny(p)) {
    const dim3 grid(static_cast<unsigned>((n_out + dev::kSkinnyRowsPerBlock - 1) / dev::kSkinnyRowsPerBlock),
                    static_cast<unsigned>(max_active));
    moe_skinny_kernel<S, F><<<grid, dev::kSkinnyThreads, 0, stream>>>(experts, ws, p.hidden, p.inter, p.act);
  } else {
    const int64_t max_tiles = (slots + kTileM - 1) / kTileM + max_active;
    BG_CHECK(max_tiles <= 65535, "moe_expert_ffn_cuda: {} row tiles exceed the grid's y limit", max_tiles);
    const dim3 grid(static_cast<unsigned>((n_out + kTileN - 1) / kTileN), static_cast<unsigned>(max_tiles));
    moe_tiled_kernel<S, F><<<grid, kTiledThreads, 0, stream>>>(experts, ws, static_cast<int>(p.shape.n_slots), p.hidden,
                                                               p.inter, p.act);
  }
  BG_CUDA_CHECK_LAUNCH();
}

template <WeightFormat F>
void launch_ffn(const MoeCudaParams& p, const ExpertWeightsCuda* experts, const MoeWorkspace& ws,
                cudaStream_t stream) {
  launch_stage<Stage::kGateUp, F>(p, experts, ws, stream);
  launch_stage<Stage::kDown, F>(p, experts, ws, stream);
}

}  // namespace

void moe_expert_ffn_cuda(const MoeCudaParams& p, const ExpertWeightsCuda* experts, const MoeWorkspace& ws,
                         cudaStream_t stream) {
  moe_check_params(p);
  if (p.shape.n_tokens == 0) return;
  BG_CHECK(experts != nullptr && ws.error_flags != nullptr, "moe_expert_ffn_cuda: null expert table or error word");
  switch (p.expert_format) {
    case WeightFormat::kDense: return launch_ffn<WeightFormat::kDense>(p, experts, ws, stream);
    case WeightFormat::kFp8Block: return launch_ffn<WeightFormat::kFp8Block>(p, experts, ws, stream);
    case WeightFormat::kMxfp4: return launch_ffn<WeightFormat::kMxfp4>(p, experts, ws, stream);
  }
  fail("moe_expert_ffn_cuda: unknown weight format {}", static_cast<int>(p.expert_format));
}

}  // namespace bg::ops

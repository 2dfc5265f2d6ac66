// MLA decode attention kernel (FlashMLA class): one CTA per (KV partition, head group), 2 warpgroups, tensor cores
// for Q·Kᵀ and P·V with the heads as the MMA N dimension, cp.async double-buffered 64-position latent tiles, online
// softmax in fp32 (log2 units), unnormalised partials for tokens split across partitions.
//
// Per tile (64 positions x 576, 72 KiB, loaded once and used by both products):
//   1. Q·Kᵀ: warpgroup g computes the partial Sᵀ[64, Hc] over columns [288g, 288g + 288) (18 k16 steps).
//   2. The two partials are exchanged through shared memory: warpgroup g finishes the softmax of heads
//      [g Hc/2, (g+1) Hc/2) (scale, mask past the context, 64-row max across its 4 warps, exp2, running sum) and
//      writes their P (bf16, [head][position]) and rescale factors alpha.
//   3. P·V: warpgroup g rescales and accumulates Oᵀ[channels 256g..256g+255, all Hc heads] (4 m64 chunks x 4 k16).
// Cost model per tile and CTA (Hc = 48): 2 x 64 x 48 x (576 + 512) = 6.68 MFLOP = 68 m64n48k16 = 1632 clocks at an
// SM's dense bf16 peak (4096 FLOP/clk), on 73.7 KB of cache (each tile is read by the n_groups CTAs of its partition:
// K3 has 2 head groups, the second read comes from L2). K3 does 181 FLOP per cache byte, above the ridge (~173), so
// 0.7 of read needs ~585 TFLOP/s of useful MMA. Shared-memory traffic per tile:
//   mma.sync: 8 warps x (A 9 KB + B 27 KB) for Q·Kᵀ + 8 x (8 + 6) KB for P·V + 24 KB exchange + 72 KB cp.async
//             ≈ 500 KB -> 13 FLOP/B against the ~32 FLOP/B the tensor cores need at 128 B/clk: ≤ 0.4 of peak,
//             predicted 0.2-0.3 of read. A correct baseline.
//   wgmma:    68 x (2 + 1.5) KB operands ≈ 240 KB + 96 KB -> 28 FLOP/B: MMA phases ≤ 0.88 of peak (~1860 clk);
//             the serial exchange + softmax + barriers add ~400-600 clk: tensor utilisation ~0.65-0.7, predicted
//             0.55-0.7 of read at B >= 16, context >= 4k (docs/MLA_DECODE.md: cost model, next steps).
// Resources (ptxas, sm_90a, Hc = 48): wgmma 255 registers, mma.sync 255, no spills; 223,552 B dynamic shared
// memory -> 1 CTA (256 threads) per SM. Per thread: O 4 x 24 fp32, S 24 fp32, softmax state 12, fragments.
// Never put a 64-bit division or a __trap in this kernel: ptxas then serialises every wgmma (C7520).
#include <cmath>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "ops/mla/mla_decode_internal.h"
#include "ops/mla/mla_decode_mma.cuh"

namespace bg::ops::mla_decode {
namespace {

using bf16 = __nv_bfloat16;

// Lazy rescaling: the running max (log2 units) is raised only when a tile's max exceeds it by more than this, so most
// tiles leave every head's alpha at exactly 1 and the warps skip rescaling O. P = 2^(s - max) then stays below 2^8,
// well inside bf16 and the fp32 sums; the output normalises by a sum taken against the same max, and split tokens
// hand that max to the combine, so the result is the same softmax (up to rounding).
constexpr float kStaleMaxLog2 = 8.0f;

// Running softmax state of the heads a warpgroup owns: n8 tiles [g kNT/2, (g+1) kNT/2), 2 columns each per thread.
template <int kNT>
struct SoftmaxState {
  float max[kNT / 2][2];  // log2 units; -inf before the first tile
  float sum[kNT / 2][2];  // partial sum over this thread's 2 rows, rescaled with the max
};


// Steps 2 (exchange) and the softmax half of step 2 for one tile: returns nothing, leaves P and alpha in shared
// memory and the updated state in `st`.
template <int kNT>
__device__ __forceinline__ void softmax_tile(uint8_t* smem, float (&s)[kNT * 4], int n_rows, float scale_log2,
                                             SoftmaxState<kNT>& st) {
  using L = Smem<kNT>;
  constexpr int kHalf = kNT / 2, kOwn = kHalf * 4, kHalfHeads = L::kHeads / 2;
  const int tid = threadIdx.x, wg = warpgroup_index(), w = warp_in_group(), lane = tid % 32, wtid = tid % 128;
  // Exchange: warpgroup 0 owns n8 tiles [0, kHalf), warpgroup 1 the rest; each hands the other its partial.
  float* xch = reinterpret_cast<float*>(smem + L::kXch);
  float own[kOwn];
#pragma unroll
  for (int i = 0; i < kOwn; ++i) {
    own[i] = wg == 0 ? s[i] : s[kOwn + i];
    xch[(wg * kOwn + i) * 128 + wtid] = wg == 0 ? s[kOwn + i] : s[i];
  }
  __syncthreads();
  const int row0 = acc_row(lane, w, 0);  // this thread's rows: row0 and row0 + 8
  float* red = reinterpret_cast<float*>(smem + L::kRed) + wg * 4 * kHalfHeads;
  // Per head column: the max over this thread's 2 rows, then over the warp's 16 rows (3 shuffle rounds, the kHalf x 2
  // columns' shuffles interleaved so their latencies overlap).
  float m[kHalf][2];
#pragma unroll
  for (int jj = 0; jj < kHalf; ++jj) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m[jj][e] = -INFINITY;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 4 * jj + 2 * r + e;
        const float v = (own[i] + xch[((1 - wg) * kOwn + i) * 128 + wtid]) * scale_log2;
        own[i] = row0 + 8 * r < n_rows ? v : -INFINITY;
        m[jj][e] = fmaxf(m[jj][e], own[i]);
      }
    }
  }
#pragma unroll
  for (int offset = 4; offset <= 16; offset *= 2) {
#pragma unroll
    for (int jj = 0; jj < kHalf; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) m[jj][e] = fmaxf(m[jj][e], __shfl_xor_sync(0xffffffffu, m[jj][e], offset));
    }
  }
  if (lane < 4) {
#pragma unroll
    for (int jj = 0; jj < kHalf; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) red[w * kHalfHeads + acc_col(lane, 4 * jj + e)] = m[jj][e];
    }
  }
  warpgroup_barrier(wg);
  float* alpha_s = reinterpret_cast<float*>(smem + L::kAlpha);
  uint8_t* p_s = smem + L::kP;
#pragma unroll
  for (int jj = 0; jj < kHalf; ++jj) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = acc_col(lane, 4 * jj + e);  // head within this warpgroup's half
      const float tile_max = fmaxf(fmaxf(red[col], red[kHalfHeads + col]),
                                   fmaxf(red[2 * kHalfHeads + col], red[3 * kHalfHeads + col]));
      // The running max moves only when the tile's exceeds it by more than kStaleMaxLog2 (finite: row 0 of every
      // tile is inside the context); otherwise alpha is exactly 1 and P stays below 2^kStaleMaxLog2.
      const float m_new = tile_max > st.max[jj][e] + kStaleMaxLog2 ? tile_max : st.max[jj][e];
      const float alpha = exp2f(st.max[jj][e] - m_new);  // 0 on the first tile, 1 while the max stands
      st.max[jj][e] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float p = exp2f(own[4 * jj + 2 * r + e] - m_new);
        sum += p;
        const int head = wg * kHalfHeads + col, row = row0 + 8 * r;
        *reinterpret_cast<bf16*>(p_s + p_offset(head, row)) = __float2bfloat16(p);
      }
      st.sum[jj][e] = st.sum[jj][e] * alpha + sum;
      if (w == 0 && lane < 4) alpha_s[wg * kHalfHeads + col] = alpha;
    }
  }
  fence_proxy_async();  // P is read by wgmma (async proxy) after the barrier
  __syncthreads();
}

// One 64-position tile: steps 1-3 of the header.
template <int kNT, class Mma>
__device__ __forceinline__ void attend_tile(uint8_t* smem, uint32_t tile, int n_rows, float scale_log2,
                                            SoftmaxState<kNT>& st, float (&o)[4][kNT * 4]) {
  using L = Smem<kNT>;
  const int tid = threadIdx.x, wg = warpgroup_index(), lane = tid % 32;
  const uint32_t base = smem_addr(smem);
  float s[kNT * 4];
#pragma unroll
  for (int i = 0; i < kNT * 4; ++i) s[i] = 0.0f;
  Mma::template qk<kNT>(tile, base + L::kQ, wg * kKStepsPerWg, s);
  softmax_tile<kNT>(smem, s, n_rows, scale_log2, st);
  const float* alpha_s = reinterpret_cast<const float*>(smem + L::kAlpha);
  float alpha[kNT][2];
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    alpha[j][0] = alpha_s[acc_col(lane, 4 * j)];
    alpha[j][1] = alpha_s[acc_col(lane, 4 * j + 1)];
  }
  // alpha is exactly 1 for every head whose max did not grow (most tiles past the first few): the warp then skips
  // the multiplications, which would change no bit.
  bool rescale = false;
#pragma unroll
  for (int j = 0; j < kNT; ++j) rescale = rescale || alpha[j][0] != 1.0f || alpha[j][1] != 1.0f;
  if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int i = 0; i < kNT * 4; ++i) o[c][i] *= alpha[i / 4][i % 2];
    }
  }
  Mma::template pv<kNT>(tile, base + L::kP, wg, o);
}

// End of a segment: the softmax sums over the whole CTA, then either the normalised bf16 latent (the token is not
// split) or the unnormalised fp32 partial with its max and sum (it is).
template <int kNT>
__device__ __forceinline__ void finish_segment(const AttentionArgs& a, uint8_t* smem, int64_t t, int64_t g, int hg,
                                               const SoftmaxState<kNT>& st, const float (&o)[4][kNT * 4]) {
  using L = Smem<kNT>;
  constexpr int kHalf = kNT / 2, kHeads = L::kHeads, kHalfHeads = kHeads / 2;
  const int tid = threadIdx.x, wg = warpgroup_index(), w = warp_in_group(), lane = tid % 32;
  float* red = reinterpret_cast<float*>(smem + L::kRed) + wg * 4 * kHalfHeads;
  float* sum_s = reinterpret_cast<float*>(smem + L::kSum);
  float* max_s = reinterpret_cast<float*>(smem + L::kMax);
#pragma unroll
  for (int jj = 0; jj < kHalf; ++jj) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = st.sum[jj][e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) red[w * kHalfHeads + acc_col(lane, 4 * jj + e)] = v;
    }
  }
  warpgroup_barrier(wg);
  if (w == 0 && lane < 4) {
#pragma unroll
    for (int jj = 0; jj < kHalf; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = acc_col(lane, 4 * jj + e);  // lane < 4
        sum_s[wg * kHalfHeads + col] =
            (red[col] + red[kHalfHeads + col]) + (red[2 * kHalfHeads + col] + red[3 * kHalfHeads + col]);
        max_s[wg * kHalfHeads + col] = st.max[jj][e];
      }
    }
  }
  __syncthreads();

  const int32_t* meta = a.meta;
  const int h0 = hg * kHeads, n_valid = min(kHeads, a.n_heads - h0);
  if (meta[MlaDecodeMeta::n_splits(a.n_tokens) + t] <= 1) {
    bf16* out = a.o_lat + (t * a.n_heads + h0) * kLora;
#pragma unroll
    for (int i = 0; i < kNT * 4; ++i) {
      const int h = acc_col(lane, i);
      if (h >= n_valid) continue;
      const float inv = 1.0f / sum_s[h];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        out[h * kLora + pv_channel(wg, c, acc_row(lane, w, i))] = __float2bfloat16(o[c][i] * inv);
      }
    }
    return;
  }
  const int64_t slot = meta[MlaDecodeMeta::slot_base(a.n_tokens) + t] +
                       (g - meta[MlaDecodeMeta::first_partition(a.n_tokens) + t]);
  float* po = a.part_o + (slot * a.n_groups + hg) * kLora * kHeads;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int i = 0; i < kNT * 4; i += 2) {  // elements i, i + 1 are adjacent heads of one channel
      *reinterpret_cast<float2*>(po + pv_channel(wg, c, acc_row(lane, w, i)) * kHeads + acc_col(lane, i)) =
          make_float2(o[c][i], o[c][i + 1]);
    }
  }
  if (tid < kHeads) {
    float* pml = a.part_ml + (slot * a.n_groups + hg) * 2 * kHeads;
    pml[tid] = max_s[tid];
    pml[kHeads + tid] = sum_s[tid];
  }
}

// Tiles [tile_lo, tile_hi) of token t's context: load, attend tile by tile (double-buffered), finish.
template <int kNT, class Mma>
__device__ __forceinline__ void run_segment(const AttentionArgs& a, uint8_t* smem, int64_t t, int tile_lo,
                                            int tile_hi, int64_t g, int hg) {
  using L = Smem<kNT>;
  const uint32_t base = smem_addr(smem);
  const int64_t n_ctx = a.cache.positions[t] + 1;
  const int32_t* table = a.cache.block_tables + static_cast<int64_t>(a.cache.seq_idx[t]) * a.cache.max_blocks_per_seq;
  const int h0 = hg * L::kHeads, n_tiles = tile_hi - tile_lo;
  load_q<kNT>(base + L::kQ, a.q_full + (t * a.n_heads + h0) * kEntry, min(L::kHeads, a.n_heads - h0));
  load_rows<kTile>(base + L::kTiles, a.cache, table, a.block_size, static_cast<int64_t>(tile_lo) * kTile, n_ctx);
  cp_async_commit();
  if (n_tiles > 1) {
    load_rows<kTile>(base + L::kTiles + kTileBytes, a.cache, table, a.block_size,
                     static_cast<int64_t>(tile_lo + 1) * kTile, n_ctx);
    cp_async_commit();
  }
  float o[4][kNT * 4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
#pragma unroll
    for (int i = 0; i < kNT * 4; ++i) o[c][i] = 0.0f;
  }
  SoftmaxState<kNT> st;
#pragma unroll
  for (int jj = 0; jj < kNT / 2; ++jj) {
    st.max[jj][0] = st.max[jj][1] = -INFINITY;
    st.sum[jj][0] = st.sum[jj][1] = 0.0f;
  }
  for (int i = 0; i < n_tiles; ++i) {
    if (i + 1 < n_tiles) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();  // the tile (and Q) are read by wgmma after the barrier
    __syncthreads();
    const uint32_t tile = base + L::kTiles + (i % 2) * kTileBytes;
    const int64_t first = static_cast<int64_t>(tile_lo + i) * kTile;
    const int n_rows = static_cast<int>(min(static_cast<int64_t>(kTile), n_ctx - first));
    attend_tile<kNT, Mma>(smem, tile, n_rows, a.scale_log2, st, o);
    __syncthreads();  // every warp is done with this buffer, P and alpha
    if (i + 2 < n_tiles) {
      load_rows<kTile>(tile, a.cache, table, a.block_size, first + 2 * kTile, n_ctx);
      cp_async_commit();
    }
  }
  finish_segment<kNT>(a, smem, t, g, hg, st, o);
  __syncthreads();  // the next segment overwrites Q, the tiles and the sums
}

// grid: n_partitions * n_groups (the head groups of one partition are adjacent, so they run together and the second
// reads each tile from L2). Partitions past the step's n_used exit at once.
template <int kNT, class Mma>
__global__ void __launch_bounds__(kThreads, 1) attention_kernel(const AttentionArgs a) {
  extern __shared__ uint8_t smem_raw[];
  // Aligned to 1024 by pointer arithmetic on the shared array (not through an integer), so the compiler keeps the
  // shared address space: st.shared / ld.shared rather than generic accesses with 64-bit addresses.
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int64_t g = blockIdx.x / a.n_groups;
  const int hg = static_cast<int>(blockIdx.x % a.n_groups);
  if (g >= a.meta[MlaDecodeMeta::kPartitionsUsed]) return;
  for_each_segment(a.meta, a.n_tokens, g, [&](int64_t t, int tile_lo, int tile_hi) {
    run_segment<kNT, Mma>(a, smem, t, tile_lo, tile_hi, g, hg);
  });
}

template <int kNT, class Mma>
void launch(const MlaDecodePlan& plan, const AttentionArgs& args, cudaStream_t stream) {
  constexpr int kSmem = Smem<kNT>::kDynamicBytes;
  // Above the 48 KiB default: opt in (a host-side attribute, allowed while a stream is being captured).
  BG_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel<kNT, Mma>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const auto grid = static_cast<unsigned>(plan.n_partitions * plan.n_groups);
  attention_kernel<kNT, Mma><<<grid, kThreads, kSmem, stream>>>(args);
  BG_CUDA_CHECK_LAUNCH();
}

template <int kNT, class Mma>
MlaDecodeKernelInfo info() {
  cudaFuncAttributes attr{};
  BG_CUDA_CHECK(cudaFuncGetAttributes(&attr, attention_kernel<kNT, Mma>));
  return {attr.numRegs, attr.localSizeBytes, static_cast<size_t>(Smem<kNT>::kDynamicBytes)};
}

// Calls f(std::integral_constant<int, kNT>, Mma) for the plan's head-group size (Hc = 8 kNT) and MMA policy.
template <class F>
auto dispatch(const MlaDecodePlan& plan, F&& f) {
  const bool wgmma = plan.mma == MlaDecodeMma::kWgmma;
  switch (plan.group_heads) {
    case 48:
      return wgmma ? f(std::integral_constant<int, 6>{}, Wgmma{}) : f(std::integral_constant<int, 6>{}, MmaSync{});
    case 32:
      return wgmma ? f(std::integral_constant<int, 4>{}, Wgmma{}) : f(std::integral_constant<int, 4>{}, MmaSync{});
    case 16:
      return wgmma ? f(std::integral_constant<int, 2>{}, Wgmma{}) : f(std::integral_constant<int, 2>{}, MmaSync{});
    default:
      fail("mla_decode: {} heads per group has no kernel (16, 32 or 48)", plan.group_heads);
  }
}

}  // namespace

void launch_attention(const MlaDecodePlan& plan, const AttentionArgs& args, cudaStream_t stream) {
  if (plan.mma == MlaDecodeMma::kWgmmaHeadsM) {
    launch_attention_heads_m(plan, args, stream);
    return;
  }
  dispatch(plan, [&](auto nt, auto mma) { launch<decltype(nt)::value, decltype(mma)>(plan, args, stream); });
}

size_t attention_smem_bytes(const MlaDecodePlan& plan) {
  if (plan.mma == MlaDecodeMma::kWgmmaHeadsM) return attention_smem_bytes_heads_m(plan);
  return dispatch(plan, [](auto nt, auto) { return static_cast<size_t>(Smem<decltype(nt)::value>::kDynamicBytes); });
}

MlaDecodeKernelInfo attention_kernel_info(const MlaDecodePlan& plan) {
  if (plan.mma == MlaDecodeMma::kWgmmaHeadsM) return attention_kernel_info_heads_m(plan);
  return dispatch(plan, [](auto nt, auto mma) { return info<decltype(nt)::value, decltype(mma)>(); });
}

}  // namespace bg::ops::mla_decode

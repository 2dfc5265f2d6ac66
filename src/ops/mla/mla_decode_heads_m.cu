// MLA decode attention with the heads as the MMA M dimension (MlaDecodeMma::kWgmmaHeadsM; FlashMLA's orientation):
// one CTA per (KV partition, head group) as in mla_decode_attention.cu, with the same arguments, schedule and outputs,
// but the work of a tile reordered so that the loads, Q·Kᵀ, the softmax and P·V overlap instead of running in turn.
//
// Per 32-position half tile i (36 KiB, a ring of four in shared memory, three loads in flight):
//   Q·Kᵀ  S[64 head rows, 32] = Q (A, shared) · half tile (B, shared): warpgroup g takes columns [288g, 288g + 288)
//         (18 wgmma m64n32k16), the two fp32 partials are exchanged through shared memory and both warpgroups add
//         them in the same order, so both hold the same S.
//   softmax per head row, in registers: a row's 32 scores sit in one lane quad (two shuffles); the lazy running max
//         of the heads-as-N kernel (raised only past 2^8), so alpha is exactly 1 on most tiles.
//   P·V   O[64, 256 channels of warpgroup g] += P · V: P is the S accumulator repacked to bf16 as the A fragments
//         (registers, no shared memory), V the same half tile read MN-major (8 wgmma m64n64k16, channels contiguous).
// Order per warpgroup: Q·Kᵀ(i + 1) is issued, then P·V(i); the wait for Q·Kᵀ(i + 1) leaves P·V(i) running on the
// tensor cores while the exchange and softmax(i + 1) run, and the buffer of half i - 1 is refilled (half i + 3) once
// both warpgroups' P·V(i - 1) are done.
//
// Rows: the group's Hc heads (48 for Kimi-K3) padded to wgmma's 64. Rows Hc..63 of Q are not stored: the m64 operand
// reads the next slab's first rows there (the last slab a zero pad), so those rows of S, P and O are garbage that no
// valid row depends on (row r of S and O depends on row r of Q only) and nothing writes out. The price: the MMA does
// 64/48 of the useful work.
//
// Shared memory (Hc = 48): Q 9 x 6144 B + 2 KiB pad, the ring 4 x 36 KiB, the exchange 16 KiB: 221,184 B -> 1 CTA of
// 256 threads per SM. Never put a 64-bit division or a __trap here: ptxas then serialises every wgmma (C7520).
#include <cmath>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/mla/mla_decode_internal.h"
#include "ops/mla/mla_decode_mma.cuh"

namespace bg::ops::mla_decode {
namespace {

using bf16 = __nv_bfloat16;

constexpr float kStaleMaxLog2 = 8.0f;  // as the heads-as-N kernel (mla_decode_attention.cu)
constexpr int kRing = 4;               // half-tile buffers
constexpr int kSAcc = 16;              // S accumulators per thread (m64n32)

template <int kNT>
struct HmSmem {
  static constexpr int kHeads = kNT * 8;
  static constexpr int kQSlabBytes = kHeads * 128;
  static constexpr int kQ = 0;                                     // [Hc, 576] in 9 slabs
  static constexpr int kQPad = 9 * kQSlabBytes;                    // rows Hc..63 past the last slab: zeros
  static constexpr int kRing = kQPad + (64 - kHeads) * 128;        // = 1024 Hc + 8192: 1024-aligned
  static constexpr int kXch = kRing + mla_decode::kRing * static_cast<int>(kHalfTileBytes);  // [2 wg][16][128] fp32
  static constexpr int kBytes = kXch + 2 * kSAcc * 128 * 4;
  static constexpr int kDynamicBytes = kBytes + 1024;  // slack to align the dynamic base to 1024
  static_assert(kRing % 1024 == 0 && kXch % 1024 == 0, "SW128 atoms must be 1024-byte aligned");
  static_assert(kDynamicBytes <= 232448, "over the 227 KiB of shared memory a CTA may use");
};

// d[64 x 32] = (accumulate ? d : 0) + A (descriptor, K-major) · B (descriptor, K-major). The first k-step passes
// accumulate = false instead of zeroing d with ordinary instructions, which ptxas would have to order against the
// wgmma still in flight (it then serialises every wgmma of the kernel: C7515).
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], uint64_t a, uint64_t b, bool accumulate) {
#ifdef BG_MLA_NO_WGMMA
  __trap();
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(static_cast<uint32_t>(accumulate))
      : "memory");
#endif
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Running softmax state of this thread's two head rows (16w + lane/4 and + 8).
struct RowState {
  float max[2];  // log2 units; -inf before the first half tile
  float sum[2];  // partial over this thread's 8 columns of the row, rescaled with the max
};

// S (summed over both warpgroups) of a half tile with n_rows valid positions -> the probabilities v (fp32, in place),
// alpha (the rescale of O for these rows) and the state.
__device__ __forceinline__ void softmax_half(float (&v)[kSAcc], int n_rows, float scale_log2, RowState& st,
                                             float (&alpha)[2]) {
  const int t = threadIdx.x % 4;
  float m[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < kSAcc; ++i) {
    const int col = 8 * (i / 4) + 2 * t + i % 2;
    v[i] = col < n_rows ? v[i] * scale_log2 : -INFINITY;
    m[(i / 2) % 2] = fmaxf(m[(i / 2) % 2], v[i]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
    m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
    // Column 0 is inside the context, so the half's max is finite; the running max moves only past kStaleMaxLog2.
    const float m_new = m[r] > st.max[r] + kStaleMaxLog2 ? m[r] : st.max[r];
    alpha[r] = exp2f(st.max[r] - m_new);  // 0 on the first half tile, 1 while the max stands
    st.max[r] = m_new;
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kSAcc; ++i) {
    v[i] = exp2f(v[i] - st.max[(i / 2) % 2]);
    sum[(i / 2) % 2] += v[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) st.sum[r] = st.sum[r] * alpha[r] + sum[r];
}

// The probabilities as P·V's A fragments (bf16).
__device__ __forceinline__ void pack_p(const float (&v)[kSAcc], uint32_t (&p)[2][4]) {
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
    for (int reg = 0; reg < 4; ++reg) p[kk][reg] = pack_bf16(v[hm_p_src(kk, reg)], v[hm_p_src(kk, reg) + 1]);
  }
}

// One segment (tiles [tile_lo, tile_hi) of token t) for warpgroup kWg.
template <int kNT, int kWg>
struct Segment {
  using L = HmSmem<kNT>;
  const AttentionArgs& a;
  uint8_t* smem;
  uint32_t base;
  const int32_t* table;
  int64_t n_ctx, first0;
  int n;  // half tiles
  float o[4][32];
  float s[kSAcc];
  uint32_t p[2][4];  // P of the half tile in P·V, bf16 A fragments of its two k-steps
  float alpha[2];
  RowState st;

  __device__ __forceinline__ uint32_t ring(int i) const { return base + L::kRing + (i & (kRing - 1)) * kHalfTileBytes; }
  __device__ __forceinline__ int rows_of(int i) const {
    return static_cast<int>(min(static_cast<int64_t>(kHalfTile), n_ctx - (first0 + i * kHalfTile)));
  }
  __device__ __forceinline__ void load(int i) {
    load_rows<kHalfTile>(ring(i), a.cache, table, a.block_size, first0 + i * kHalfTile, n_ctx);
  }

  // Issues Q·Kᵀ of half i into s (overwritten: the first k-step does not accumulate) as one wgmma group.
  __device__ __forceinline__ void issue_qk(int i) {
    wgmma_fence();
    const DescWords qa = desc_words(desc_k_major(base + L::kQ)), kb = desc_words(desc_k_major(ring(i)));
#pragma unroll
    for (int j = 0; j < kKStepsPerWg; ++j) {
      const int kk = kWg * kKStepsPerWg + j;
      wgmma_ss_n32(s, at(qa, hm_qk_a_start(kk, L::kQSlabBytes)), at(kb, hm_qk_b_start(kk)), j > 0);
    }
    wgmma_commit();
  }

  // Issues P·V of half i as one wgmma group.
  __device__ __forceinline__ void issue_pv(int i) {
    fence_operands(p[0]);
    fence_operands(p[1]);
    wgmma_fence();  // P and the rescaled O were written by ordinary instructions
    const DescWords vb = desc_words(sw128_desc(ring(i), kHmPvLbo, kHmPvSbo));
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int cb = 0; cb < 4; ++cb) wgmma_rs_n64(o[cb], p[kk], at(vb, hm_pv_b_start(kWg, cb, kk)));
    }
    wgmma_commit();
  }

  // The other warpgroup's partial S added to this one's (the same order in both: identical S, identical P).
  __device__ __forceinline__ void exchange() {
    float* xch = reinterpret_cast<float*>(smem + L::kXch);
    const int wtid = threadIdx.x % 128;
#pragma unroll
    for (int k = 0; k < kSAcc; ++k) xch[(kWg * kSAcc + k) * 128 + wtid] = s[k];
    __syncthreads();  // also: both warpgroups' P·V of the half before the last are done (its buffer is free)
  }
  __device__ __forceinline__ void add_exchanged() {
    const float* xch = reinterpret_cast<const float*>(smem + L::kXch);
    const int wtid = threadIdx.x % 128;
#pragma unroll
    for (int k = 0; k < kSAcc; ++k) {
      const float other = xch[((1 - kWg) * kSAcc + k) * 128 + wtid];
      s[k] = kWg == 0 ? s[k] + other : other + s[k];
    }
  }

  // Rescales O by alpha: exactly 1 for every row whose max did not move (most halves past the first), and the warp
  // then leaves O alone. P·V of the last half is done (the wait at the end of its step).
  __device__ __forceinline__ void rescale_o() {
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int cb = 0; cb < 4; ++cb) {
#pragma unroll
        for (int k = 0; k < 32; ++k) o[cb][k] *= alpha[(k / 2) % 2];
      }
    }
  }

  // Half i < n - 1: P(i) is in p, alpha its rescale, every wgmma done. Leaves P(i + 1) in p the same way.
  __device__ __forceinline__ void step(int i) {
    cp_async_wait<1>();  // this thread's copies of half i + 1 landed
    fence_proxy_async();
    __syncthreads();     // everyone's did; everyone is past the exchange of half i
    issue_qk(i + 1);
    rescale_o();
    issue_pv(i);
    ptx::wgmma_wait<1>();  // Q·Kᵀ(i + 1) done; P·V(i) runs on while the exchange and the softmax of i + 1 do
    fence_operands(s);
    exchange();
    if (i + 3 < n) load(i + 3);  // into half i - 1's buffer
    cp_async_commit();
    add_exchanged();
    softmax_half(s, rows_of(i + 1), a.scale_log2, st, alpha);
    ptx::wgmma_wait<0>();  // P·V(i) done: p may be rewritten
#pragma unroll
    for (int cb = 0; cb < 4; ++cb) fence_operands(o[cb]);
    fence_operands(p[0]);
    fence_operands(p[1]);
    pack_p(s, p);
  }

  // The last half.
  __device__ __forceinline__ void last_step(int i) {
    rescale_o();
    issue_pv(i);
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int cb = 0; cb < 4; ++cb) fence_operands(o[cb]);
    fence_operands(p[0]);
    fence_operands(p[1]);
  }

  __device__ __forceinline__ void run(int64_t t, int64_t g, int hg) {
    const int h0 = hg * L::kHeads;
    load_q<kNT>(base + L::kQ, a.q_full + (t * a.n_heads + h0) * kEntry, min(L::kHeads, a.n_heads - h0));
    // Halves 0..2 (three groups, Q with the first); a group is committed for every half, empty or not, so the
    // wait before half i + 1 is always cp_async_wait<1>.
    for (int i = 0; i < kRing - 1; ++i) {
      if (i < n) load(i);
      cp_async_commit();
    }
#pragma unroll
    for (int cb = 0; cb < 4; ++cb) {
#pragma unroll
      for (int k = 0; k < 32; ++k) o[cb][k] = 0.0f;
    }
    st.max[0] = st.max[1] = -INFINITY;
    st.sum[0] = st.sum[1] = 0.0f;
    cp_async_wait<kRing - 2>();
    fence_proxy_async();
    __syncthreads();
    issue_qk(0);
    ptx::wgmma_wait<0>();
    fence_operands(s);
    exchange();
    add_exchanged();
    softmax_half(s, rows_of(0), a.scale_log2, st, alpha);
    pack_p(s, p);
    for (int i = 0; i + 1 < n; ++i) step(i);
    last_step(n - 1);
    finish(t, g, hg);
  }

  // The softmax sums over the row's quad, then the normalised bf16 latent (token not split) or the unnormalised fp32
  // partial with its max and sum (split), as the heads-as-N kernel writes them.
  __device__ __forceinline__ void finish(int64_t t, int64_t g, int hg) {
    const int lane = threadIdx.x % 32, w = warp_in_group(), quad = lane % 4;
    float sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sum[r] = st.sum[r];
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
      sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    }
    const int32_t* meta = a.meta;
    const int h0 = hg * L::kHeads, n_valid = min(L::kHeads, a.n_heads - h0);
    if (meta[MlaDecodeMeta::n_splits(a.n_tokens) + t] <= 1) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int head = 16 * w + lane / 4 + 8 * r;
        if (head >= n_valid) continue;
        const float inv = 1.0f / sum[r];
        bf16* out = a.o_lat + (t * a.n_heads + h0 + head) * kLora + kChannelsPerWg * kWg;
#pragma unroll
        for (int cb = 0; cb < 4; ++cb) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int ch = 64 * cb + 8 * j + 2 * quad;
            *reinterpret_cast<__nv_bfloat162*>(out + ch) =
                __floats2bfloat162_rn(o[cb][4 * j + 2 * r] * inv, o[cb][4 * j + 2 * r + 1] * inv);
          }
        }
      }
      return;
    }
    const int64_t slot = meta[MlaDecodeMeta::slot_base(a.n_tokens) + t] +
                         (g - meta[MlaDecodeMeta::first_partition(a.n_tokens) + t]);
    float* po = a.part_o + (slot * a.n_groups + hg) * kLora * L::kHeads;
    float* pml = a.part_ml + (slot * a.n_groups + hg) * 2 * L::kHeads;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = 16 * w + lane / 4 + 8 * r;
      if (head >= L::kHeads) continue;
#pragma unroll
      for (int cb = 0; cb < 4; ++cb) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int ch = kChannelsPerWg * kWg + 64 * cb + 8 * j + 2 * quad + e;
            po[ch * L::kHeads + head] = o[cb][4 * j + 2 * r + e];
          }
        }
      }
      if (kWg == 0 && quad == 0) {
        pml[head] = st.max[r];
        pml[L::kHeads + head] = sum[r];
      }
    }
  }
};

// grid: n_partitions * n_groups, as the heads-as-N kernel (partitions past the step's n_used exit at once).
template <int kNT>
__global__ void __launch_bounds__(kThreads, 1) heads_m_kernel(const AttentionArgs a) {
  using L = HmSmem<kNT>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int64_t g = blockIdx.x / a.n_groups;
  const int hg = static_cast<int>(blockIdx.x % a.n_groups);
  if (g >= a.meta[MlaDecodeMeta::kPartitionsUsed]) return;
  // The zero pad after Q's last slab (read by rows Hc..63 of its last k-steps), written once; the first segment's
  // barriers order it before any wgmma.
  for (int i = static_cast<int>(threadIdx.x); i < (64 - L::kHeads) * 8; i += kThreads) {
    *reinterpret_cast<uint4*>(smem + L::kQPad + i * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  const int wg = warpgroup_index();
  for_each_segment(a.meta, a.n_tokens, g, [&](int64_t t, int tile_lo, int tile_hi) {
    const int64_t n_ctx = a.cache.positions[t] + 1;
    const int64_t first0 = static_cast<int64_t>(tile_lo) * kTile;
    const int64_t last = min(n_ctx, static_cast<int64_t>(tile_hi) * kTile);  // > first0: row 0 of a tile is inside
    const int n = (static_cast<int>(last - first0) + static_cast<int>(kHalfTile) - 1) / static_cast<int>(kHalfTile);
    const int32_t* table =
        a.cache.block_tables + static_cast<int64_t>(a.cache.seq_idx[t]) * a.cache.max_blocks_per_seq;
    if (wg == 0) {
      Segment<kNT, 0> seg{a, smem, smem_addr(smem), table, n_ctx, first0, n};
      seg.run(t, g, hg);
    } else {
      Segment<kNT, 1> seg{a, smem, smem_addr(smem), table, n_ctx, first0, n};
      seg.run(t, g, hg);
    }
    __syncthreads();  // the next segment overwrites Q, the ring and the exchange
  });
}

template <int kNT>
void launch(const MlaDecodePlan& plan, const AttentionArgs& args, cudaStream_t stream) {
  constexpr int kSmem = HmSmem<kNT>::kDynamicBytes;
  BG_CUDA_CHECK(cudaFuncSetAttribute(heads_m_kernel<kNT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const auto grid = static_cast<unsigned>(plan.n_partitions * plan.n_groups);
  heads_m_kernel<kNT><<<grid, kThreads, kSmem, stream>>>(args);
  BG_CUDA_CHECK_LAUNCH();
}

template <int kNT>
MlaDecodeKernelInfo info() {
  cudaFuncAttributes attr{};
  BG_CUDA_CHECK(cudaFuncGetAttributes(&attr, heads_m_kernel<kNT>));
  return {attr.numRegs, attr.localSizeBytes, static_cast<size_t>(HmSmem<kNT>::kDynamicBytes)};
}

// Calls f(std::integral_constant<int, kNT>) for the plan's head-group size (Hc = 8 kNT).
template <class F>
auto dispatch(const MlaDecodePlan& plan, F&& f) {
  switch (plan.group_heads) {
    case 48: return f(std::integral_constant<int, 6>{});
    case 32: return f(std::integral_constant<int, 4>{});
    case 16: return f(std::integral_constant<int, 2>{});
    default: fail("mla_decode (heads as M): {} heads per group has no kernel (16, 32 or 48)", plan.group_heads);
  }
}

}  // namespace

void launch_attention_heads_m(const MlaDecodePlan& plan, const AttentionArgs& args, cudaStream_t stream) {
  dispatch(plan, [&](auto nt) { launch<decltype(nt)::value>(plan, args, stream); });
}

size_t attention_smem_bytes_heads_m(const MlaDecodePlan& plan) {
  return dispatch(plan, [](auto nt) { return static_cast<size_t>(HmSmem<decltype(nt)::value>::kDynamicBytes); });
}

MlaDecodeKernelInfo attention_kernel_info_heads_m(const MlaDecodePlan& plan) {
  return dispatch(plan, [](auto nt) { return info<decltype(nt)::value>(); });
}

}  // namespace bg::ops::mla_decode

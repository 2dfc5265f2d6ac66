// MLA prefill attention, the mma.sync kernel (FlashAttention-2 formulation; MlaPrefillMma::kMmaSync).
//
// One CTA of 4 warps per (work item, head); a work item is up to 128 query rows of one sequence against up to one
// pass's keys of that sequence. Each warp owns 32 query rows (two m16 tiles) for the whole kernel, so every K / V
// fragment read from shared memory feeds four mma.sync.m16n8k16. Per 64-key tile:
//   S = Q Kᵀ    (Q [128, 192] and K [64, 192] in shared memory, 12 k-steps)
//   online softmax in registers (log2 domain, causal mask by position only on the tiles that need it)
//   O += P V    (P from the S accumulators as bf16 A fragments, V [64, 128] read with ldmatrix.trans)
// The V tile loads while S is computed and the next K tile while P V is, single-buffered (92 KiB of shared memory,
// two CTAs per SM). Rows of shared memory are padded by 16 bytes, so ldmatrix reads them without bank conflicts.
#include "backend/cuda/cuda_check.h"
#include "ops/mla/mla_prefill_internal.cuh"

namespace bg::ops::mla_prefill {
namespace {

constexpr int kThreads = 128;
constexpr int kTileK = static_cast<int>(kMlaPrefillTileK);  // 64 keys per tile
constexpr int kQkStride = kQk + 8;                          // bf16 per shared row: 400 B
constexpr int kVStride = kV + 8;                            // 272 B
constexpr int kSmemQ = kTileQ * kQkStride * 2;
constexpr int kSmemK = kTileK * kQkStride * 2;
constexpr int kSmemV = kTileK * kVStride * 2;
constexpr int kSmemBytes = kSmemQ + kSmemK + kSmemV;  // 94208

// d += A (16x16) B (16x8), bf16 in, fp32 accumulate. Not volatile: a pure register operation the compiler may
// schedule freely.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// K tile: rows j < n_valid are keys g0 + kt * 64 + j (k_nope of this head | k_pe), the rest zeros.
__device__ __forceinline__ void load_k(const AttnArgs& a, int head, int64_t g_first, int n_valid, bf16* k_s) {
  const int64_t kv_row = int64_t{a.n_heads} * kNope;
  for (int c = threadIdx.x; c < kTileK * (kQk / 8); c += kThreads) {
    const int r = c / (kQk / 8), chunk = c % (kQk / 8);
    const bool ok = r < n_valid;
    const int64_t g = g_first + (ok ? r : 0);
    const bf16* src = chunk < kNope / 8 ? a.k_nope + g * kv_row + int64_t{head} * kNope + chunk * 8
                                        : a.k_pe + g * kRope + (chunk - kNope / 8) * 8;
    cp_async16(smem_addr(k_s + r * kQkStride + chunk * 8), src, ok ? 16u : 0u);
  }
}
__device__ __forceinline__ void load_v(const AttnArgs& a, int head, int64_t g_first, int n_valid, bf16* v_s) {
  const int64_t kv_row = int64_t{a.n_heads} * kV;
  for (int c = threadIdx.x; c < kTileK * (kV / 8); c += kThreads) {
    const int r = c / (kV / 8), chunk = c % (kV / 8);
    const bool ok = r < n_valid;
    const int64_t g = g_first + (ok ? r : 0);
    cp_async16(smem_addr(v_s + r * kVStride + chunk * 8), a.v + g * kv_row + int64_t{head} * kV + chunk * 8,
               ok ? 16u : 0u);
  }
}

// S = Q Kᵀ of one tile for this warp's 32 rows: 12 k16 steps, each K fragment pair feeding four mma.
__device__ __forceinline__ void qk_tile(uint32_t q_lane, uint32_t k_lane, float (&s)[2][8][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
  }
#pragma unroll
  for (int kk = 0; kk < kQk / 16; ++kk) {
    uint32_t qa[2][4];
    ldmatrix_x4(qa[0], q_lane + kk * 32);
    ldmatrix_x4(qa[1], q_lane + 16 * kQkStride * 2 + kk * 32);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t kb[4];
      ldmatrix_x4(kb, k_lane + np * 16 * kQkStride * 2 + kk * 32);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma16816(s[mt][2 * np], qa[mt], kb[0], kb[1]);
        mma16816(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
      }
    }
  }
}

// O += P V of one tile: 4 k16 steps over the keys, V fragments by ldmatrix.trans.
__device__ __forceinline__ void pv_tile(uint32_t v_lane, const uint32_t (&pa)[2][4][4], float (&o)[2][16][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_lane + (kk * 16 * kVStride + np * 16) * 2);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma16816(o[mt][2 * np], pa[mt][kk], vb[0], vb[1]);
        mma16816(o[mt][2 * np + 1], pa[mt][kk], vb[2], vb[3]);
      }
    }
  }
}

// Online softmax of one 64-key tile (log2 units; the causal mask only where some row may not see a key): rescales o,
// updates the maxima and sums, and leaves P as bf16 A fragments in pa.
__device__ __forceinline__ void softmax_tile(float (&s)[2][8][4], const int (&qrel)[2][2], float (&m)[2][2],
                                             float (&l)[2][2], float (&o)[2][16][4], uint32_t (&pa)[2][4][4],
                                             int key0, bool mask, int n_keys, float scale_log2, int lane) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int last = min(qrel[mt][r], n_keys - 1);  // the last key index this row sees
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[mt][nt][2 * r + e] * scale_log2;
          if (mask && key0 + 8 * nt + 2 * (lane % 4) + e > last) x = -INFINITY;
          s[mt][nt][2 * r + e] = x;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[mt][r], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row that has seen nothing yet stays at zero
      const float alpha = exp2f(m[mt][r] - m_use);
      m[mt][r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(s[mt][nt][2 * r + e] - m_use);
          s[mt][nt][2 * r + e] = p;
          sum += p;
        }
      }
      l[mt][r] = l[mt][r] * alpha + sum;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        o[mt][nt][2 * r] *= alpha;
        o[mt][nt][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      pa[mt][kk][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      pa[mt][kk][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      pa[mt][kk][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      pa[mt][kk][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
  }
}

// grid: (items, heads). See the file comment.
__global__ void __launch_bounds__(kThreads, 2) mla_prefill_attention_kernel(AttnArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* k_s = reinterpret_cast<bf16*>(smem + kSmemQ);
  bf16* v_s = reinterpret_cast<bf16*>(smem + kSmemQ + kSmemK);

  const MlaPrefillItem it = a.items[blockIdx.x];
  const int head = static_cast<int>(blockIdx.y);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_tiles = (it.n_keys + kTileK - 1) / kTileK;

  // Q tile (rows past n_rows are zeros) and the first K tile.
  for (int c = threadIdx.x; c < kTileQ * (kQk / 8); c += kThreads) {
    const int r = c / (kQk / 8), chunk = c % (kQk / 8);
    const bool ok = r < it.n_rows;
    const bf16* src = a.q + int64_t{it.q_row0 + (ok ? r : 0)} * a.q_row + int64_t{head} * a.q_head + chunk * 8;
    cp_async16(smem_addr(q_s + r * kQkStride + chunk * 8), src, ok ? 16u : 0u);
  }
  load_k(a, head, it.g0, min(kTileK, it.n_keys), k_s);
  cp_async_commit();

  // This thread's four query rows: row(mt, r) = 32 warp + 16 mt + lane / 4 + 8 r. qrel = position - k0 (the last
  // key index it may see); kNoPosition for rows past the tile.
  int qrel[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 32 * warp + 16 * mt + lane / 4 + 8 * r;
      qrel[mt][r] = row < it.n_rows ? static_cast<int>(a.positions[it.q_row0 + row] - it.k0) : kNoPosition;
    }
  }

  float o[2][16][4];
  float m[2][2], l[2][2];
  const bool load_state = (it.flags & kMlaPrefillLoadState) != 0;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 32 * warp + 16 * mt + lane / 4 + 8 * r;
      const int64_t sr = int64_t{it.q_row0 + row} * a.n_heads + head;
      load_row_state(a, sr, load_state && row < it.n_rows, lane, m[mt][r], l[mt][r],
                     [&](int c8) { return AccPair{o[mt][c8][2 * r], o[mt][c8][2 * r + 1]}; });
    }
  }

  cp_async_wait_all();
  __syncthreads();

  const uint32_t q_base = smem_addr(q_s), k_base = smem_addr(k_s), v_base = smem_addr(v_s);
  // ldmatrix lane addresses. A (Q, row-major): row lane % 16, column 8 (lane / 16). B from K rows (non-transposed):
  // key (lane % 8) + 8 (lane / 16), column 8 ((lane / 8) % 2). B from V rows (transposed): key (lane % 8) +
  // 8 ((lane / 8) % 2), column 8 (lane / 16).
  const uint32_t q_lane = q_base + ((32 * warp + lane % 16) * kQkStride + 8 * (lane / 16)) * 2;
  const uint32_t k_lane = k_base + ((lane % 8 + 8 * (lane / 16)) * kQkStride + 8 * ((lane / 8) % 2)) * 2;
  const uint32_t v_lane = v_base + ((lane % 8 + 8 * ((lane / 8) % 2)) * kVStride + 8 * (lane / 16)) * 2;

  for (int kt = 0; kt < n_tiles; ++kt) {
    const int key0 = kt * kTileK;
    load_v(a, head, it.g0 + key0, min(kTileK, it.n_keys - key0), v_s);
    cp_async_commit();

    float s[2][8][4];
    qk_tile(q_lane, k_lane, s);
    uint32_t pa[2][4][4];  // P as A fragments: [m tile][k16 step][4]
    softmax_tile(s, qrel, m, l, o, pa, key0, key0 + kTileK > it.mask_from || key0 + kTileK > it.n_keys, it.n_keys,
                 a.scale_log2, lane);

    cp_async_wait_all();  // V of this tile
    __syncthreads();      // ... visible to all, and every warp is done reading K
    if (kt + 1 < n_tiles) {
      load_k(a, head, it.g0 + key0 + kTileK, min(kTileK, it.n_keys - key0 - kTileK), k_s);
      cp_async_commit();
    }
    pv_tile(v_lane, pa, o);
    cp_async_wait_all();  // the next K tile
    __syncthreads();      // ... visible, and every warp is done reading V
  }

  // Epilogue: the normalised output (the tile's last keys) or the state for the next pass.
  const bool final_pass = (it.flags & kMlaPrefillFinal) != 0;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 32 * warp + 16 * mt + lane / 4 + 8 * r;
      float sum = l[mt][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (row >= it.n_rows) continue;
      store_row(a, int64_t{it.q_row0 + row} * a.n_heads + head, final_pass, lane, m[mt][r], sum,
                [&](int c8) { return make_float2(o[mt][c8][2 * r], o[mt][c8][2 * r + 1]); });
    }
  }
}

}  // namespace

void launch_attention_mma_sync(const AttnArgs& a, unsigned n_items, unsigned n_heads, cudaStream_t stream) {
  BG_CUDA_CHECK(cudaFuncSetAttribute(mla_prefill_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     kSmemBytes));
  mla_prefill_attention_kernel<<<dim3(n_items, n_heads), kThreads, kSmemBytes, stream>>>(a);
  BG_CUDA_CHECK_LAUNCH();
}

MlaPrefillKernelInfo attention_info_mma_sync() {
  cudaFuncAttributes attr{};
  BG_CUDA_CHECK(cudaFuncGetAttributes(&attr, mla_prefill_attention_kernel));
  return {attr.numRegs, attr.localSizeBytes, static_cast<size_t>(kSmemBytes)};
}

}  // namespace bg::ops::mla_prefill

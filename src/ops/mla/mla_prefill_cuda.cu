// MLA prefill launcher and kernels (mla_prefill_cuda.h): per pass, gather -> two batched cuBLAS GEMMs (k_nope, v)
// -> FlashAttention-2-style attention. One stream, no host synchronisation, no allocation.
//
// Attention kernel: one CTA of 4 warps per (work item, head); a work item is up to 128 query rows of one sequence
// against up to one pass's keys of that sequence. Each warp owns 32 query rows (two m16 tiles) for the whole kernel,
// so every K / V fragment read from shared memory feeds four mma.sync.m16n8k16. Per 64-key tile:
//   S = Q Kᵀ    (Q [128, 192] and K [64, 192] in shared memory, 12 k-steps)
//   online softmax in registers (log2 domain, causal mask by position only on the tiles that need it)
//   O += P V    (P from the S accumulators as bf16 A fragments, V [64, 128] read with ldmatrix.trans)
// The V tile loads while S is computed and the next K tile while P V is, single-buffered (92 KiB of shared memory,
// two CTAs per SM). Rows of shared memory are padded by 16 bytes, so ldmatrix reads them without bank conflicts.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/mla/mla_decode_mma.cuh"
#include "ops/mla/mla_prefill_cuda.h"

namespace bg::ops {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;
constexpr int kTileQ = static_cast<int>(kMlaPrefillTileQ);  // 128
constexpr int kTileK = static_cast<int>(kMlaPrefillTileK);  // 64
constexpr int kQk = static_cast<int>(kMlaPrefillQk);        // 192
constexpr int kNope = static_cast<int>(kMlaPrefillNope);    // 128
constexpr int kRope = static_cast<int>(kMlaPrefillRope);    // 64
constexpr int kV = static_cast<int>(kMlaPrefillV);          // 128
constexpr int kQkStride = kQk + 8;                          // bf16 per shared row: 400 B
constexpr int kVStride = kV + 8;                            // 272 B
constexpr int kSmemQ = kTileQ * kQkStride * 2;
constexpr int kSmemK = kTileK * kQkStride * 2;
constexpr int kSmemV = kTileK * kVStride * 2;
constexpr int kSmemBytes = kSmemQ + kSmemK + kSmemV;  // 94208
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kNoPosition = 0x7fffffff;  // query rows past the tile: see every key

struct AttnArgs {
  const bf16* q;          // row t, head h at q + t * q_row + h * q_head; 192 values (nope 128 | rope 64)
  int64_t q_row, q_head;  // elements
  const bf16* k_nope;     // [rows, H, 128]
  const bf16* v;          // [rows, H, 128]
  const bf16* k_pe;       // [rows, 64]
  const int64_t* positions;
  const MlaPrefillItem* items;
  bf16* out;  // [n_tokens, H, v_head]
  float* state_o;
  float* state_ml;
  int n_heads, v_head;
  float scale_log2;
};

// The PTX primitives the decode kernel defines (cp.async, ldmatrix, the wgmma fences).
using mla_decode::cp_async16;
using mla_decode::cp_async_commit;
using mla_decode::fence_operands;
using mla_decode::fence_proxy_async;
using mla_decode::ldmatrix_x4;
using mla_decode::ldmatrix_x4_trans;
using mla_decode::smem_addr;
using mla_decode::wgmma_commit;
using mla_decode::wgmma_fence;
__device__ __forceinline__ void cp_async_wait_all() { mla_decode::cp_async_wait<0>(); }

// d += A (16x16) B (16x8), bf16 in, fp32 accumulate. Not volatile: a pure register operation the compiler may
// schedule freely.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// One query row's softmax state and output, shared by both kernels. A thread holds, per row, two adjacent columns of
// each of the 16 n8 tiles of the 128 output columns: 8 c8 + 2 (lane % 4) + {0, 1}; `acc(c8)` is that float2.
// Continues a stored state (have) or starts empty: o, the running max and the quad's sum (kept in one lane).
template <typename Acc>
__device__ __forceinline__ void load_row_state(const AttnArgs& a, int64_t sr, bool have, int lane, float& m, float& l,
                                               Acc acc) {
  m = have ? a.state_ml[2 * sr] : -INFINITY;
  l = have && lane % 4 == 0 ? a.state_ml[2 * sr + 1] : 0.0f;
#pragma unroll
  for (int c8 = 0; c8 < kV / 8; ++c8) {
    const int col = 8 * c8 + 2 * (lane % 4);
    acc(c8) = have ? make_float2(a.state_o[sr * kV + col], a.state_o[sr * kV + col + 1]) : make_float2(0.0f, 0.0f);
  }
}
// The normalised output (final: the tile's last keys) or the unnormalised state for the next pass. `sum` is the
// row's whole sum (reduced over the quad).
template <typename Acc>
__device__ __forceinline__ void store_row(const AttnArgs& a, int64_t sr, bool final_pass, int lane, float m, float sum,
                                          Acc acc) {
  if (final_pass) {
    const float inv = 1.0f / sum;
    bf16* dst = a.out + sr * a.v_head;
#pragma unroll
    for (int c8 = 0; c8 < kV / 8; ++c8) {
      const int col = 8 * c8 + 2 * (lane % 4);
      const float2 v = acc(c8);
      if (col < a.v_head) dst[col] = __float2bfloat16(v.x * inv);
      if (col + 1 < a.v_head) dst[col + 1] = __float2bfloat16(v.y * inv);
    }
    return;
  }
  float* dst = a.state_o + sr * kV;
#pragma unroll
  for (int c8 = 0; c8 < kV / 8; ++c8) *reinterpret_cast<float2*>(dst + 8 * c8 + 2 * (lane % 4)) = acc(c8);
  if (lane % 4 == 0) {
    a.state_ml[2 * sr] = m;
    a.state_ml[2 * sr + 1] = sum;
  }
}
// A thread's view of two accumulator registers as the float2 of one (row, n8 tile).
struct AccPair {
  float& x;
  float& y;
  __device__ __forceinline__ AccPair& operator=(float2 v) {
    x = v.x;
    y = v.y;
    return *this;
  }
  __device__ __forceinline__ operator float2() const { return make_float2(x, y); }
};

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

    // Online softmax (log2 units). Masking only where some row of the tile may not see a key.
    const bool mask = key0 + kTileK > it.mask_from || key0 + kTileK > it.n_keys;
    uint32_t pa[2][4][4];  // P as A fragments: [m tile][k16 step][4]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int last = min(qrel[mt][r], it.n_keys - 1);  // the last key index this row sees
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mt][nt][2 * r + e] * a.scale_log2;
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

    cp_async_wait_all();  // V of this tile
    __syncthreads();      // ... visible to all, and every warp is done reading K
    if (kt + 1 < n_tiles) {
      load_k(a, head, it.g0 + key0 + kTileK, min(kTileK, it.n_keys - key0 - kTileK), k_s);
      cp_async_commit();
    }

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

// ---- wgmma kernel (sm_90a) ----------------------------------------------------------------------------------------
// One CTA of two warpgroups per (work item, head); warpgroup g owns query rows 64g .. 64g + 63. Per 128-key tile:
//   S = Q Kᵀ   12 wgmma m64n128k16, both operands from shared memory (K-major)
//   online softmax on the accumulators (the same per-warp fragment layout as mma.sync)
//   O += P V   8 k-steps x 2 wgmma m64n64k16, P from registers, V from shared memory read N-major (transposed)
// K and V tiles are double-buffered: tile kt + 1 loads (cp.async, all threads) while tile kt computes. Operands live
// in the 128-byte-swizzle layout of wgmma (slabs of 64 columns; row r's 16-byte chunk c at r * 128 + (c ^ r % 8) * 16).
namespace wg {

constexpr int kThreads = 256;
constexpr int kTileK = 96;                    // keys per tile (S: 48 accumulators per thread)
constexpr int kSAcc = kTileK / 2;             // S accumulators per thread
constexpr int kPSteps = kTileK / 16;          // k16 steps of P·V
constexpr int kSlabQ = kTileQ * 128;   // 16 KiB: 128 rows x 64 columns
constexpr int kSlabKv = kTileK * 128;  // 12 KiB
constexpr int kQBytes = 3 * kSlabQ;    // [128, 192]
constexpr int kKBytes = 3 * kSlabKv;   // [96, 192]
constexpr int kVBytes = 2 * kSlabKv;   // [96, 128]
constexpr int kStageBytes = kKBytes + kVBytes;
constexpr int kBytes = kQBytes + 2 * kStageBytes;  // 172032
constexpr int kDynamicBytes = kBytes + 1024;       // slack to align the base to 1024 (SW128 atoms)
static_assert(kDynamicBytes <= 232448, "over the 227 KiB of shared memory a CTA may use");

__device__ __forceinline__ uint32_t sw128(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}
// Shared-memory matrix descriptor: start >> 4, leading byte offset >> 4 at bit 16, stride byte offset >> 4 at bit
// 32, 128-byte swizzle (bit 62). K-major: leading offset unused (1), 8-row groups 1024 B apart. N-major inside one
// 64-column slab: leading offset unused at N = 64, 8-row (k) groups 1024 B apart.
__device__ __forceinline__ uint64_t desc(uint32_t start) {
  return static_cast<uint64_t>((start & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// d[64 x 96] (= / +=) A[64 x 16] · B[16 x 96], both K-major in shared memory; accumulate = 0 overwrites d.
__device__ __forceinline__ void wgmma_ss_n96(float (&d)[48], uint64_t a, uint64_t b, int accumulate) {
#ifdef BG_MLA_NO_WGMMA
  __trap();
#else
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, "
      "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
      : "l"(a), "l"(b), "r"(accumulate)
      : "memory");
#endif
}

// d[64 x 64] += A[64 x 16] (registers, mma.sync A-fragment layout per warp) · B[16 x 64] (shared memory, N-major).
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

// K or V rows g_first .. g_first + n_valid - 1 of one tile into a stage; rows past n_valid are zeros. Each thread
// copies one 16-byte column chunk of every 8th (K) or 16th (V) row, so the addresses only step by constants: the
// swizzled position of row r's chunk c depends on r % 8 alone.
__device__ __forceinline__ void load_k(const AttnArgs& a, int head, int64_t g_first, int n_valid, uint32_t k_s) {
  constexpr int kCols = kQk / 8;  // 24 chunks per row; threads 0..191
  if (threadIdx.x >= 8 * kCols) return;
  const int col = threadIdx.x % kCols, row0 = threadIdx.x / kCols;
  const int64_t row_stride = col < kNope / 8 ? int64_t{a.n_heads} * kNope : kRope;
  const bf16* src = col < kNope / 8 ? a.k_nope + (g_first + row0) * row_stride + int64_t{head} * kNope + col * 8
                                    : a.k_pe + (g_first + row0) * row_stride + (col - kNope / 8) * 8;
  const uint32_t dst = k_s + (col / 8) * kSlabKv + sw128(row0, col % 8);
#pragma unroll
  for (int i = 0; i < kTileK / 8; ++i) {
    const bool ok = row0 + 8 * i < n_valid;
    cp_async16(dst + i * 1024, ok ? src + 8 * i * row_stride : src, ok ? 16u : 0u);
  }
}
__device__ __forceinline__ void load_v(const AttnArgs& a, int head, int64_t g_first, int n_valid, uint32_t v_s) {
  constexpr int kCols = kV / 8;  // 16 chunks per row; all 256 threads
  const int col = threadIdx.x % kCols, row0 = threadIdx.x / kCols;
  const int64_t row_stride = int64_t{a.n_heads} * kV;
  const bf16* src = a.v + (g_first + row0) * row_stride + int64_t{head} * kV + col * 8;
  const uint32_t dst = v_s + (col / 8) * kSlabKv + sw128(row0, col % 8);
#pragma unroll
  for (int i = 0; i < kTileK / 16; ++i) {
    const bool ok = row0 + 16 * i < n_valid;
    cp_async16(dst + i * 2048, ok ? src + 16 * i * row_stride : src, ok ? 16u : 0u);
  }
}

// S = Q Kᵀ for this warpgroup's 64 rows against one K stage: 12 asynchronous wgmma, committed as one group (the
// caller issues wgmma.fence first).
__device__ __forceinline__ void issue_s(float (&s)[kSAcc], uint32_t q_wg, uint32_t k_s) {
#pragma unroll
  for (int kk = 0; kk < kQk / 16; ++kk) {
    wgmma_ss_n96(s, desc(q_wg + (kk / 4) * kSlabQ + (kk % 4) * 32), desc(k_s + (kk / 4) * kSlabKv + (kk % 4) * 32),
                 kk > 0);
  }
  wgmma_commit();
}

// Online softmax of one tile's scores (log2 units; the causal mask only where some row may not see a key): the new
// maxima and sums, the factor alpha by which o must be rescaled, and P as bf16 A fragments for the P·V wgmma.
__device__ __forceinline__ void softmax_tile(float (&s)[kSAcc], const int (&qrel)[2], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], uint32_t (&pa)[kPSteps][4], int key0, bool mask,
                                             int n_keys, float scale_log2, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int last = min(qrel[r], n_keys - 1);
    float mx = -INFINITY;  // of the raw scores (the scale is positive, so it commutes with the maximum)
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (mask && key0 + 8 * j + 2 * (lane % 4) + e > last) s[4 * j + 2 * r + e] = -INFINITY;
        mx = fmaxf(mx, s[4 * j + 2 * r + e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[r], mx * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row that has seen nothing yet stays at zero
    alpha[r] = exp2f(m[r] - m_use);
    m[r] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kTileK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = exp2f(fmaf(s[4 * j + 2 * r + e], scale_log2, -m_use));
        s[4 * j + 2 * r + e] = p;
        sum += p;
      }
    }
    l[r] = l[r] * alpha[r] + sum;
  }
#pragma unroll
  for (int kk = 0; kk < kPSteps; ++kk) {
    pa[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

__global__ void __launch_bounds__(kThreads, 1) attention_kernel(AttnArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_s = base;
  auto k_stage = [&](int s) { return base + kQBytes + s * kStageBytes; };
  auto v_stage = [&](int s) { return base + kQBytes + s * kStageBytes + kKBytes; };

  const MlaPrefillItem it = a.items[blockIdx.x];
  const int head = static_cast<int>(blockIdx.y);
  const int wgi = threadIdx.x / 128, w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int n_tiles = (it.n_keys + kTileK - 1) / kTileK;

  if (threadIdx.x < 8 * (kQk / 8)) {  // Q: as load_k, one column chunk of every 8th row per thread
    const int col = threadIdx.x % (kQk / 8), row0 = threadIdx.x / (kQk / 8);
    const bf16* src = a.q + int64_t{it.q_row0 + row0} * a.q_row + int64_t{head} * a.q_head + col * 8;
    const uint32_t dst = q_s + (col / 8) * kSlabQ + sw128(row0, col % 8);
#pragma unroll
    for (int i = 0; i < kTileQ / 8; ++i) {
      const bool ok = row0 + 8 * i < it.n_rows;
      cp_async16(dst + i * 1024, ok ? src + 8 * i * a.q_row : src, ok ? 16u : 0u);
    }
  }
  load_k(a, head, it.g0, min(kTileK, it.n_keys), k_stage(0));
  load_v(a, head, it.g0, min(kTileK, it.n_keys), v_stage(0));
  cp_async_commit();

  // This thread's two query rows: 64 wg + 16 w + lane / 4 + 8 r.
  int qrel[2];
  float m[2], l[2];
  float o[2][32];  // o[half][4j + 2r + e]: column 64 half + 8j + 2 (lane % 4) + e
  const bool load_state = (it.flags & kMlaPrefillLoadState) != 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 64 * wgi + 16 * w + lane / 4 + 8 * r;
    qrel[r] = row < it.n_rows ? static_cast<int>(a.positions[it.q_row0 + row] - it.k0) : kNoPosition;
    const int64_t sr = int64_t{it.q_row0 + row} * a.n_heads + head;
    load_row_state(a, sr, load_state && row < it.n_rows, lane, m[r], l[r], [&](int c8) {
      return AccPair{o[c8 / 8][4 * (c8 % 8) + 2 * r], o[c8 / 8][4 * (c8 % 8) + 2 * r + 1]};
    });
  }

  // Software pipeline (P(kt) in registers and o rescaled up to tile kt at the start of iteration kt):
  //   wait the loads of K(kt + 1) and V(kt); barrier (every warpgroup is done with S(kt) and P·V(kt - 1), so K stage
  //   kt % 2 and V stage (kt + 1) % 2 are free); issue S(kt + 1) and P·V(kt); load V(kt + 1) and K(kt + 2); wait
  //   S(kt + 1) only and run its softmax on the CUDA cores while P·V(kt) runs on the tensor cores; wait P·V(kt);
  //   rescale o. No ordinary instruction writes a wgmma accumulator while a wgmma that uses it is in flight.
  const uint32_t q_wg = q_s + 64 * wgi * 128;  // this warpgroup's 64 rows inside each Q slab
  if (n_tiles > 1) {
    load_k(a, head, it.g0 + kTileK, min(kTileK, it.n_keys - kTileK), k_stage(1));
    cp_async_commit();
  }
  cp_async_wait_all();  // Q, K(0), V(0), K(1)
  fence_proxy_async();
  __syncthreads();
  float s[kSAcc], alpha[2];
  uint32_t pa0[kPSteps][4], pa1[kPSteps][4];
  wgmma_fence();
  issue_s(s, q_wg, k_stage(0));
  wgmma_wait<0>();
  fence_operands(s);
  softmax_tile(s, qrel, m, l, alpha, pa0, 0, kTileK > it.mask_from || kTileK > it.n_keys, it.n_keys, a.scale_log2,
               lane);
  auto rescale = [&] {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          o[h][4 * j + 2 * r] *= alpha[r];
          o[h][4 * j + 2 * r + 1] *= alpha[r];
        }
      }
    }
  };
  rescale();  // a continued state's o (zeros otherwise)
  // Start of iteration kt: the loads of K(kt + 1) and V(kt) landed, every warpgroup past S(kt) and P·V(kt - 1).
  // The writes of s, o and pa (softmax, rescale) are pinned before the wgmma that use them: the compiler may otherwise
  // sink the rescale of o past the issue of S, which makes ptxas serialise every wgmma.
  auto begin_tile = [&] {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    fence_operands(s);
    fence_operands(o[0]);
    fence_operands(o[1]);
    wgmma_fence();
  };
  auto issue_pv = [&](int stage, const uint32_t (&pa)[kPSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
#pragma unroll
      for (int h = 0; h < 2; ++h) wgmma_rs_n64(o[h], pa[kk], desc(v_stage(stage) + h * kSlabKv + kk * 2048));
    }
    wgmma_commit();
  };
  // A tile with a successor (the branch-free shape ptxas needs to see that wait_group 1 retires S before the
  // softmax reads it).
  auto step = [&](int kt, const uint32_t (&pa_cur)[kPSteps][4], uint32_t (&pa_next)[kPSteps][4]) {
    const int key0 = kt * kTileK, stage = kt % 2, next0 = key0 + kTileK;
    begin_tile();
    issue_s(s, q_wg, k_stage(1 - stage));
    issue_pv(stage, pa_cur);
    load_v(a, head, it.g0 + next0, min(kTileK, it.n_keys - next0), v_stage(1 - stage));
    if (next0 + kTileK < it.n_keys) {
      load_k(a, head, it.g0 + next0 + kTileK, min(kTileK, it.n_keys - next0 - kTileK), k_stage(stage));
    }
    cp_async_commit();
    wgmma_wait<1>();  // S(kt + 1); P·V(kt) may still run
    fence_operands(s);
    const bool mask = next0 + kTileK > it.mask_from || next0 + kTileK > it.n_keys;
    softmax_tile(s, qrel, m, l, alpha, pa_next, next0, mask, it.n_keys, a.scale_log2, lane);
    wgmma_wait<0>();
    fence_operands(o[0]);
    fence_operands(o[1]);
    rescale();
  };
  auto last = [&](int kt, const uint32_t (&pa_cur)[kPSteps][4]) {
    begin_tile();
    issue_pv(kt % 2, pa_cur);
    wgmma_wait<0>();
    fence_operands(o[0]);
    fence_operands(o[1]);
  };
  int kt = 0;
#pragma unroll 1
  for (; kt + 2 < n_tiles; kt += 2) {
    step(kt, pa0, pa1);
    step(kt + 1, pa1, pa0);
  }
  if (kt + 1 < n_tiles) {
    step(kt, pa0, pa1);
    last(kt + 1, pa1);
  } else {
    last(kt, pa0);
  }

  const bool final_pass = (it.flags & kMlaPrefillFinal) != 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 64 * wgi + 16 * w + lane / 4 + 8 * r;
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (row >= it.n_rows) continue;
    store_row(a, int64_t{it.q_row0 + row} * a.n_heads + head, final_pass, lane, m[r], sum, [&](int c8) {
      return make_float2(o[c8 / 8][4 * (c8 % 8) + 2 * r], o[c8 / 8][4 * (c8 % 8) + 2 * r + 1]);
    });
  }
}

}  // namespace wg

// grid: (ceil(max segment len / 8), segments), block 256: one warp per gathered row. c_kv [rows, lora] and k_pe
// [rows, 64] (zero past rope) from the paged cache.
struct GatherArgs {
  const MlaPrefillSegment* segments;
  MlaPagedCache cache;
  bf16* c_kv;
  bf16* k_pe;
  int lora, rope, block_size;
};
__global__ void __launch_bounds__(256) mla_prefill_gather_kernel(GatherArgs a) {
  const MlaPrefillSegment seg = a.segments[blockIdx.y];
  const int j = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (j >= seg.len) return;
  const int64_t pos = int64_t{seg.k0} + j, row = int64_t{seg.row0} + j;
  const int entry = a.lora + a.rope;
  const int64_t blk_idx = pos / a.block_size;
  const bf16* src = nullptr;
  if (blk_idx < a.cache.max_blocks_per_seq) {
    const int32_t block = a.cache.block_tables[int64_t{seg.seq} * a.cache.max_blocks_per_seq + blk_idx];
    if (block >= 0) {
      src = a.cache.base + block * a.cache.block_stride + (pos % a.block_size) * entry;
    } else if (lane == 0 && a.cache.error_flags != nullptr) {
      atomicOr(a.cache.error_flags, kMlaErrorBadBlock);
    }
  } else if (lane == 0 && a.cache.error_flags != nullptr) {
    atomicOr(a.cache.error_flags, kMlaErrorBadPosition);
  }
  const bf16 zero = __float2bfloat16(0.0f);
  for (int c = lane; c < a.lora; c += 32) a.c_kv[row * a.lora + c] = src ? src[c] : zero;
  for (int c = lane; c < kRope; c += 32) a.k_pe[row * kRope + c] = (src && c < a.rope) ? src[a.lora + c] : zero;
}

// q_pad[t, h] = [q_nope zero-padded to 128 | q_pe zero-padded to 64] for the tokens of the prefill sequences' rows
// (all rows: the padded path serves small test shapes only).
__global__ void mla_prefill_pad_q_kernel(const bf16* __restrict__ q, bf16* __restrict__ q_pad, int64_t n_rows,
                                         int nope, int rope) {
  const int qk = nope + rope;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n_rows * kQk;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / kQk;
    const int c = static_cast<int>(i % kQk);
    bf16 v = __float2bfloat16(0.0f);
    if (c < nope) v = q[row * qk + c];
    if (c >= kNope && c - kNope < rope) v = q[row * qk + nope + (c - kNope)];
    q_pad[i] = v;
  }
}

bool aligned(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

}  // namespace

void mla_prefill_cuda(const MlaParams& p, const MlaPrefillPlan& plan, const MlaPrefillWorkspace& ws,
                      const __nv_bfloat16* q, const __nv_bfloat16* w_uk, const __nv_bfloat16* w_uv,
                      const MlaPagedCache& cache, __nv_bfloat16* out, const MlaPrefillContext& ctx,
                      cudaStream_t stream, MlaPrefillMma mma) {
  constexpr const char* op = "mla_prefill_cuda";
  BG_CHECK(mla_prefill_takes(p), "{}: head dims nope {} / rope {} / v {} not taken (at most {} / {} / {})", op,
           p.qk_nope_dim, p.qk_rope_dim, p.v_head_dim, kNope, kRope, kV);
  BG_CHECK(p.n_heads <= 65535, "{}: n_heads {} exceeds the grid", op, p.n_heads);
  BG_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0f, "{}: softmax_scale {} must be positive", op,
           p.softmax_scale);
  BG_CHECK(p.block_size >= 1, "{}: block_size {} must be positive", op, p.block_size);
  BG_CHECK(q && w_uk && w_uv && out && cache.base && cache.block_tables && cache.positions, "{}: null pointer", op);
  BG_CHECK(ctx.cublas && ctx.workspace && aligned(ctx.workspace, 256) && ctx.workspace_bytes >= ws.total_bytes,
           "{}: workspace of {} bytes (256-aligned) needed, {} given", op, ws.total_bytes, ctx.workspace_bytes);
  if (plan.empty()) return;
  BG_CHECK(plan.items.size() <= 0x7fffffffu && plan.segments.size() <= 65535u, "{}: plan too large", op);

  const int h = static_cast<int>(p.n_heads), nope = static_cast<int>(p.qk_nope_dim);
  const int rope = static_cast<int>(p.qk_rope_dim), v_head = static_cast<int>(p.v_head_dim);
  const int lora = static_cast<int>(p.kv_lora_rank);
  auto* base = static_cast<uint8_t*>(ctx.workspace);
  const auto* segments = reinterpret_cast<const MlaPrefillSegment*>(base + ws.segments);
  const auto* items = reinterpret_cast<const MlaPrefillItem*>(base + ws.items);
  auto* c_kv = reinterpret_cast<bf16*>(base + ws.c_kv);
  auto* k_pe = reinterpret_cast<bf16*>(base + ws.k_pe);
  auto* k_nope = reinterpret_cast<bf16*>(base + ws.k_nope);
  auto* v = reinterpret_cast<bf16*>(base + ws.v);

  // Q: read in place at the production dims (16-byte aligned rows), else through a zero-padded copy.
  AttnArgs a{};
  const bool exact = nope == kNope && rope == kRope && aligned(q, 16);
  if (exact) {
    a.q = q;
    a.q_row = int64_t{h} * kQk;
    a.q_head = kQk;
  } else {
    BG_CHECK(ws.q_pad != ws.c_kv || p.n_tokens == 0, "{}: workspace has no padded-q region", op);
    auto* q_pad = reinterpret_cast<bf16*>(base + ws.q_pad);
    const int64_t rows = p.n_tokens * h;
    const int grid = static_cast<int>(std::min<int64_t>(1024, (rows * kQk + 255) / 256));
    mla_prefill_pad_q_kernel<<<grid, 256, 0, stream>>>(q, q_pad, rows, nope, rope);
    BG_CUDA_CHECK_LAUNCH();
    a.q = q_pad;
    a.q_row = int64_t{h} * kQk;
    a.q_head = kQk;
  }
  a.k_nope = k_nope;
  a.v = v;
  a.k_pe = k_pe;
  a.positions = cache.positions;
  a.out = out;
  a.state_o = reinterpret_cast<float*>(base + ws.state_o);
  a.state_ml = reinterpret_cast<float*>(base + ws.state_ml);
  a.n_heads = h;
  a.v_head = v_head;
  a.scale_log2 = p.softmax_scale * kLog2e;

  if (mma == MlaPrefillMma::kWgmma) {
    BG_CUDA_CHECK(cudaFuncSetAttribute(wg::attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       wg::kDynamicBytes));
  } else {
    BG_CUDA_CHECK(cudaFuncSetAttribute(mla_prefill_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kSmemBytes));
  }
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the caller's workspace is bound after it.
  BG_CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
  BG_CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, ctx.cublas_workspace_bytes));
  const float one = 1.0f, zero = 0.0f;
  for (const MlaPrefillPass& pass : plan.passes) {
    const int rows = static_cast<int>(pass.rows);
    int max_len = 0;
    for (int64_t i = pass.segment_begin; i < pass.segment_begin + pass.n_segments; ++i) {
      max_len = std::max(max_len, plan.segments[static_cast<size_t>(i)].len);
    }
    const GatherArgs g{segments + pass.segment_begin, cache, c_kv, k_pe, lora, rope, static_cast<int>(p.block_size)};
    mla_prefill_gather_kernel<<<dim3(static_cast<unsigned>((max_len + 7) / 8), static_cast<unsigned>(pass.n_segments)),
                                256, 0, stream>>>(g);
    BG_CUDA_CHECK_LAUNCH();
    // Padding columns of k_nope / v (test shapes) must read as zeros: the GEMMs write only the real ones.
    if (nope < kNope) BG_CUDA_CHECK(cudaMemsetAsync(k_nope, 0, size_t(rows) * h * kNope * 2, stream));
    if (v_head < kV) BG_CUDA_CHECK(cudaMemsetAsync(v, 0, size_t(rows) * h * kV * 2, stream));
    // Per head, column-major: C [nope, rows] (ld H·128, head stride 128) = W_UK[h] ([nope, lora] row-major, i.e.
    // [lora, nope] column-major, transposed) · c_kvᵀ ([lora, rows] column-major, ld lora). Same for V with W_UV.
    BG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, nope, rows, lora, &one, w_uk,
                                               CUDA_R_16BF, lora, int64_t{nope} * lora, c_kv, CUDA_R_16BF, lora, 0,
                                               &zero, k_nope, CUDA_R_16BF, h * kNope, kNope, h, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    BG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, v_head, rows, lora, &one, w_uv,
                                               CUDA_R_16BF, lora, int64_t{v_head} * lora, c_kv, CUDA_R_16BF, lora, 0,
                                               &zero, v, CUDA_R_16BF, h * kV, kV, h, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    a.items = items + pass.item_begin;
    const dim3 grid(static_cast<unsigned>(pass.n_items), static_cast<unsigned>(h));
    if (mma == MlaPrefillMma::kWgmma) {
      wg::attention_kernel<<<grid, wg::kThreads, wg::kDynamicBytes, stream>>>(a);
    } else {
      mla_prefill_attention_kernel<<<grid, kThreads, kSmemBytes, stream>>>(a);
    }
    BG_CUDA_CHECK_LAUNCH();
  }
}

const char* mla_prefill_mma_name(MlaPrefillMma mma) { return mma == MlaPrefillMma::kWgmma ? "wgmma" : "mma.sync"; }

MlaPrefillKernelInfo mla_prefill_kernel_info(MlaPrefillMma mma) {
  cudaFuncAttributes attr{};
  if (mma == MlaPrefillMma::kWgmma) {
    BG_CUDA_CHECK(cudaFuncGetAttributes(&attr, wg::attention_kernel));
    return {attr.numRegs, attr.localSizeBytes, static_cast<size_t>(wg::kDynamicBytes)};
  }
  BG_CUDA_CHECK(cudaFuncGetAttributes(&attr, mla_prefill_attention_kernel));
  return {attr.numRegs, attr.localSizeBytes, static_cast<size_t>(kSmemBytes)};
}

}  // namespace bg::ops

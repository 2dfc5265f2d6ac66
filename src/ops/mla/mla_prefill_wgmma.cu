// MLA prefill attention, the wgmma kernel (sm_90a; MlaPrefillMma::kWgmma, the default). docs/MLA_PREFILL.md.
//
// One CTA of two warpgroups per (work item, head); warpgroup g owns query rows 64g .. 64g + 63. Per 96-key tile:
//   S = Q Kᵀ   12 wgmma m64n96k16, both operands from shared memory (K-major)
//   online softmax on the accumulators (the same per-warp fragment layout as mma.sync)
//   O += P V   6 k-steps x 2 wgmma m64n64k16, P from registers, V from shared memory read N-major (transposed)
// S of the next tile runs on the tensor cores while the softmax of this one runs on the CUDA cores. K and V tiles are
// double-buffered and load (cp.async, all threads, constant strides) one tile ahead. Operands live in the 128-byte
// swizzle layout of wgmma (slabs of 64 columns; row r's 16-byte chunk c at r * 128 + (c ^ r % 8) * 16).
#include "backend/cuda/cuda_check.h"
#include "ops/mla/mla_prefill_internal.cuh"

namespace bg::ops::mla_prefill {
namespace {

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
// Shared-memory matrix descriptor (ops/elementwise/wgmma_desc.h). K-major: leading offset unused (1), 8-row groups
// 1024 B apart. N-major inside one 64-column slab: leading offset unused at N = 64, 8-row (k) groups 1024 B apart:
// the same words.
__device__ __forceinline__ uint64_t desc(uint32_t start) { return wgmma::sw128_k_major_desc(start); }

using ptx::wgmma_wait;

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

// The item's query rows (past n_rows: zeros), as load_k: one column chunk of every 8th row per thread.
__device__ __forceinline__ void load_q(const AttnArgs& a, const MlaPrefillItem& it, int head, uint32_t q_s) {
  if (threadIdx.x >= 8 * (kQk / 8)) return;
  const int col = threadIdx.x % (kQk / 8), row0 = threadIdx.x / (kQk / 8);
  const bf16* src = a.q + int64_t{it.q_row0 + row0} * a.q_row + int64_t{head} * a.q_head + col * 8;
  const uint32_t dst = q_s + (col / 8) * kSlabQ + sw128(row0, col % 8);
#pragma unroll
  for (int i = 0; i < kTileQ / 8; ++i) {
    const bool ok = row0 + 8 * i < it.n_rows;
    cp_async16(dst + i * 1024, ok ? src + 8 * i * a.q_row : src, ok ? 16u : 0u);
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

  load_q(a, it, head, q_s);
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

}  // namespace

void launch_attention_wgmma(const AttnArgs& a, unsigned n_items, unsigned n_heads, cudaStream_t stream) {
  BG_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kDynamicBytes));
  attention_kernel<<<dim3(n_items, n_heads), kThreads, kDynamicBytes, stream>>>(a);
  BG_CUDA_CHECK_LAUNCH();
}

MlaPrefillKernelInfo attention_info_wgmma() {
  cudaFuncAttributes attr{};
  BG_CUDA_CHECK(cudaFuncGetAttributes(&attr, attention_kernel));
  return {attr.numRegs, attr.localSizeBytes, static_cast<size_t>(kDynamicBytes)};
}

}  // namespace bg::ops::mla_prefill

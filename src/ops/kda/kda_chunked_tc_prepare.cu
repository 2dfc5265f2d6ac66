// Kernel 1 of the tensor-core chunked KDA (kda_chunked_tc.cuh): per (chunk, head), the chunk-local operands W, U,
// qg, kg^T, Aqk and e^{G_last} into the workspace, from the chunk's q, k, v, g and beta alone.
#include "backend/cuda/cuda_check.h"
#include "ops/kda/kda_chunked_tc.cuh"

namespace bg::ops::kda_tc {
namespace {


struct PrepSmem {
  __nv_bfloat16* k;  // [64, 136]
  __nv_bfloat16* q;  // [64, 136]; after the A / qg phase, T [64, 65] fp32 lives here
  __nv_bfloat16* v;  // [64, 136]
  float* g;          // [64, 132] cumulative G
  float* a;          // [64, 65] A = diag(beta) strictly_lower(Kt)
  float* beta;       // [64]
  float* x;          // [16, 65] block-row scratch of the inverse
  __device__ float* t() const { return reinterpret_cast<float*>(q); }
};
constexpr int kPrepBf16Bytes = kChunk * kRowBf16 * 2;
constexpr int kPrepSmemBytes =
    3 * kPrepBf16Bytes + kChunk * kGStride * 4 + kChunk * kAStride * 4 + kChunk * 4 + 16 * kAStride * 4;
static_assert(2 * (kPrepSmemBytes + 1024) <= 233472, "two prepare CTAs per SM");
static_assert(20 * kTileBytes <= kChunk * kAStride * 4, "the T' tiles fit where A was");
static_assert(kChunk * kAStride * 4 <= kPrepBf16Bytes, "T fits where q was");

__device__ PrepSmem prep_smem(uint8_t* base) {
  PrepSmem m;
  m.k = reinterpret_cast<__nv_bfloat16*>(base);
  m.q = m.k + kChunk * kRowBf16;
  m.v = m.q + kChunk * kRowBf16;
  m.g = reinterpret_cast<float*>(m.v + kChunk * kRowBf16);
  m.a = m.g + kChunk * kGStride;
  m.beta = m.a + kChunk * kAStride;
  m.x = m.beta + kChunk;
  return m;
}

// q, k, v rows and the raw g rows by cp.async, all in flight at once (rows past n zero-filled), beta; then G by a
// running sum per channel in token order (the CPU's order), in place. Ends with a barrier.
__device__ void prep_load(const TcArgs& x, int h, Chunk ch, const PrepSmem& m) {
  const int tid = threadIdx.x;
  constexpr int kBf16Chunks = kDim / 8, kF32Chunks = kDim / 4;  // 16-byte pieces of a q / k / v row, of a g row
  // Consecutive threads copy consecutive 16-byte pieces of one row: k, q, v (1024 pieces each), then g (2048).
  for (int idx = tid; idx < kChunk * (3 * kBf16Chunks + kF32Chunks); idx += kPrepThreads) {
    const bool bf16_part = idx < 3 * kChunk * kBf16Chunks;
    const int rem = bf16_part ? idx % (kChunk * kBf16Chunks) : idx - 3 * kChunk * kBf16Chunks;
    const int i = bf16_part ? rem / kBf16Chunks : rem / kF32Chunks;
    const bool live = i < ch.n_tokens;
    const int64_t row = (static_cast<int64_t>(ch.token_begin) + (live ? i : 0)) * x.n_heads + h;
    const void* src;
    uint32_t dst;
    if (bf16_part) {
      const int which = idx / (kChunk * kBf16Chunks), c8 = (rem % kBf16Chunks) * 8;
      const __nv_bfloat16* base = which == 0 ? x.in.k : (which == 1 ? x.in.q : x.in.v);
      __nv_bfloat16* smem = which == 0 ? m.k : (which == 1 ? m.q : m.v);
      src = base + row * kDim + c8;
      dst = smem_addr(smem + i * kRowBf16 + c8);
    } else {
      const int c4 = (rem % kF32Chunks) * 4;
      src = x.in.g + row * kDim + c4;
      dst = smem_addr(m.g + i * kGStride + c4);
    }
    cp_async16(dst, src, live ? 16u : 0u);
  }
  cp_async_commit();
  if (tid < kChunk) {
    m.beta[tid] = tid < ch.n_tokens ? x.in.beta[(static_cast<int64_t>(ch.token_begin) + tid) * x.n_heads + h] : 0.0f;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (tid < kDim) {
    float run = 0.0f;
#pragma unroll 16
    for (int i = 0; i < kChunk; ++i) {
      run = i == 0 ? m.g[tid] : run + m.g[i * kGStride + tid];
      m.g[i * kGStride + tid] = run;
    }
  }
  __syncthreads();
}

// The 16x16 block (a, b), b <= a, of Kt (-> A, masked and scaled by beta, fp32 in smem) and of the query-key matrix
// (-> Aqk A tile (a, b), bf16, in the workspace); reference token r as described at the top.
__device__ void prep_pair(int a, int b, const PrepSmem& m, uint8_t* ws) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r = a == b ? 16 * b + 8 : 16 * b + 15;
  float kk[2][4] = {}, qk[2][4] = {};
#pragma unroll 1
  for (int ks = 0; ks < kDim / 16; ++ks) {
    uint32_t akh[4], akl[4], aqh[4], aql[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {  // elements e, e + 1: channels d, d + 1 of row i
      const int i = 16 * a + a_row(g, e), d = 16 * ks + a_col(t, e);
      const float2 gi = ld_f2(m.g + i * kGStride + d), gr = ld_f2(m.g + r * kGStride + d);
      const float2 kv = ld_bf2(m.k + i * kRowBf16 + d), qv = ld_bf2(m.q + i * kRowBf16 + d);
      const float f0 = __expf(gi.x - gr.x), f1 = __expf(gi.y - gr.y);
      split(kv.x * f0, kv.y * f1, akh[e / 2], akl[e / 2]);
      split(qv.x * f0, qv.y * f1, aqh[e / 2], aql[e / 2]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int j = 16 * b + 8 * nt + g;
      uint32_t bh[2], bl[2];
#pragma unroll
      for (int e = 0; e < 4; e += 2) {  // elements e, e + 1: channels d, d + 1 of row j
        const int d = 16 * ks + b_k(t, e);
        const float2 gr = ld_f2(m.g + r * kGStride + d), gj = ld_f2(m.g + j * kGStride + d);
        const float2 kv = ld_bf2(m.k + j * kRowBf16 + d);
        split(kv.x * __expf(gr.x - gj.x), kv.y * __expf(gr.y - gj.y), bh[e / 2], bl[e / 2]);
      }
      mma3(kk[nt], akh, akl, bh[0], bh[1], bl[0], bl[1]);
      mma3(qk[nt], aqh, aql, bh[0], bh[1], bl[0], bl[1]);
    }
  }
  // Accumulator element e of n-tile nt: row 16a + g + 8 (e >> 1), column 16b + 8 nt + 2t + (e & 1).
  uint32_t aqk[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float masked[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * a + g + ((e & 2) ? 8 : 0), j = 16 * b + 8 * nt + 2 * t + (e & 1);
      m.a[i * kAStride + j] = j < i ? m.beta[i] * kk[nt][e] : 0.0f;
      masked[e] = j <= i ? qk[nt][e] : 0.0f;
    }
    aqk[2 * nt] = pack(masked[0], masked[1]);  // A fragment: regs 0, 1 from n-tile 0, regs 2, 3 from n-tile 1
    aqk[2 * nt + 1] = pack(masked[2], masked[3]);
  }
  *reinterpret_cast<uint4*>(ws + kWsAqk + (4 * a + b) * kTileBytes + lane * 16) = {aqk[0], aqk[1], aqk[2], aqk[3]};
}

// qg = q o e^G (A tiles 4 x 8, bf16) and kg^T = (k o e^{G_last - G})^T (A tiles 8 x 4, hi / lo): tile `tile` of 32.
__device__ void prep_scaled_tiles(int tile, const PrepSmem& m, uint8_t* ws) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  {
    const int mt = tile / 8, kt = tile % 8;
    uint32_t r[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const int i = 16 * mt + a_row(g, e), d = 16 * kt + a_col(t, e);
      const float2 qv = ld_bf2(m.q + i * kRowBf16 + d), gi = ld_f2(m.g + i * kGStride + d);
      r[e / 2] = pack(qv.x * __expf(gi.x), qv.y * __expf(gi.y));
    }
    *reinterpret_cast<uint4*>(ws + kWsQg + tile * kTileBytes + lane * 16) = {r[0], r[1], r[2], r[3]};
  }
  {
    const int mt = tile / 4, kt = tile % 4;  // rows: key channels, columns: tokens
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      float x[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int d = 16 * mt + a_row(g, e + u), j = 16 * kt + a_col(t, e + u);
        x[u] = bf(m.k[j * kRowBf16 + d]) * __expf(m.g[(kChunk - 1) * kGStride + d] - m.g[j * kGStride + d]);
      }
      split(x[0], x[1], hi[e / 2], lo[e / 2]);
    }
    *reinterpret_cast<uint4*>(ws + kWsKgHi + tile * kTileBytes + lane * 16) = {hi[0], hi[1], hi[2], hi[3]};
    *reinterpret_cast<uint4*>(ws + kWsKgLo + tile * kTileBytes + lane * 16) = {lo[0], lo[1], lo[2], lo[3]};
  }
}

// T = (I + A)^-1 (unit lower triangular, fp32) by blocks of 16: the four diagonal blocks by forward substitution at
// once (column j by the 4 lanes 4j .. 4j + 3), then block row a = 1, 2, 3 in turn:
//   T[a, 0:a] = -T_aa (A[a, 0:a] T[0:a, 0:a])   (16 x 16a, reading only rows of earlier block rows).
__device__ void prep_inverse(const PrepSmem& m) {
  float* tm = m.t();
  for (int idx = threadIdx.x; idx < kChunk * kChunk; idx += kPrepThreads) {
    const int i = idx / kChunk, j = idx % kChunk;
    tm[i * kAStride + j] = i == j ? 1.0f : 0.0f;
  }
  __syncthreads();
  if (threadIdx.x < 4 * kChunk) {  // warps 0..7
    const int j = threadIdx.x / 4, part = threadIdx.x % 4, blk = 16 * (j / 16);  // a warp's 8 columns share a block
    for (int i = blk + 1; i < blk + 16; ++i) {
      float acc = 0.0f;
      if (i > j) {
        for (int mm = j + part; mm < i; mm += 4) acc = fmaf(m.a[i * kAStride + mm], tm[mm * kAStride + j], acc);
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      acc += __shfl_xor_sync(0xffffffffu, acc, 2);
      if (part == 0 && i > j) tm[i * kAStride + j] = -acc;
      __syncwarp();  // row i of this column is read by its 4 lanes from the next row on
    }
  }
  __syncthreads();
  for (int a = 1; a < kChunk / 16; ++a) {
    const int n_cols = 16 * a;  // columns 0 .. 16a - 1 of block row a
    for (int idx = threadIdx.x; idx < 16 * n_cols; idx += kPrepThreads) {
      const int i = idx / n_cols, col = idx % n_cols;
      float acc = 0.0f;
      for (int mm = col; mm < n_cols; ++mm) acc = fmaf(m.a[(n_cols + i) * kAStride + mm], tm[mm * kAStride + col], acc);
      m.x[i * kAStride + col] = acc;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * n_cols; idx += kPrepThreads) {
      const int i = idx / n_cols, col = idx % n_cols;
      float acc = 0.0f;
      for (int mm = 0; mm <= i; ++mm)
        acc = fmaf(tm[(n_cols + i) * kAStride + n_cols + mm], m.x[mm * kAStride + col], acc);
      tm[(n_cols + i) * kAStride + col] = -acc;
    }
    __syncthreads();
  }
}

// The 10 nonzero A tiles (mt, ks <= mt) of T' = T diag(beta), hi / lo, as mma fragments into the dead A buffer:
// tile mt (mt + 1) / 2 + ks by warp of the same number. Ends with a barrier.
__device__ void prep_tprime(const PrepSmem& m) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  if (w < 10) {
    const int mt = w >= 6 ? 3 : (w >= 3 ? 2 : (w >= 1 ? 1 : 0)), ks = w - mt * (mt + 1) / 2;
    const float* tm = m.t();
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      const int i = 16 * mt + a_row(g, e), j = 16 * ks + a_col(t, e);
      split(tm[i * kAStride + j] * m.beta[j], tm[i * kAStride + j + 1] * m.beta[j + 1], hi[e / 2], lo[e / 2]);
    }
    uint8_t* tiles = reinterpret_cast<uint8_t*>(m.a);
    *reinterpret_cast<uint4*>(tiles + w * kTileBytes + lane * 16) = {hi[0], hi[1], hi[2], hi[3]};
    *reinterpret_cast<uint4*>(tiles + (10 + w) * kTileBytes + lane * 16) = {lo[0], lo[1], lo[2], lo[3]};
  }
  __syncthreads();
}

// W = T' (k o e^G) and U = T' v for the key / value columns 16w .. 16w + 15 of warp w; T' = T diag(beta).
template <bool kIsW>
__device__ void prep_wu(const PrepSmem& m, uint8_t* ws) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  if (w >= kDim / 16) return;  // warps 8, 9: no column block
  const uint8_t* tiles = reinterpret_cast<const uint8_t*>(m.a);
  float acc[4][2][4] = {};
#pragma unroll 1
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t bh[2][2], bl[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int d = 16 * w + 8 * nt + g;
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int j0 = 16 * ks + b_k(t, e);  // j0 + 1 is element e + 1
        if constexpr (kIsW) {
          split(bf(m.k[j0 * kRowBf16 + d]) * __expf(m.g[j0 * kGStride + d]),
                bf(m.k[(j0 + 1) * kRowBf16 + d]) * __expf(m.g[(j0 + 1) * kGStride + d]), bh[nt][e / 2], bl[nt][e / 2]);
        } else {
          bh[nt][e / 2] = bits(__halves2bfloat162(m.v[j0 * kRowBf16 + d], m.v[(j0 + 1) * kRowBf16 + d]));
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      if (mt < ks) continue;  // T' is lower triangular
      uint32_t ah[4], al[4];
      const int tile = mt * (mt + 1) / 2 + ks;
      const uint4 h4 = *reinterpret_cast<const uint4*>(tiles + tile * kTileBytes + lane * 16);
      const uint4 l4 = *reinterpret_cast<const uint4*>(tiles + (10 + tile) * kTileBytes + lane * 16);
      ah[0] = h4.x, ah[1] = h4.y, ah[2] = h4.z, ah[3] = h4.w;
      al[0] = l4.x, al[1] = l4.y, al[2] = l4.z, al[3] = l4.w;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        if constexpr (kIsW) {
          mma3(acc[mt][nt], ah, al, bh[nt][0], bh[nt][1], bl[nt][0], bl[nt][1]);
        } else {
          mma(acc[mt][nt], ah, bh[nt][0], bh[nt][1]);  // v is exact in bf16
          mma(acc[mt][nt], al, bh[nt][0], bh[nt][1]);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt) {
    if constexpr (kIsW) {
      // Columns 16w .. 16w + 15 are A tile (mt, w) of W; n-tile 0 gives registers 0, 1 and n-tile 1 registers 2, 3.
      uint32_t hi[4], lo[4];
      split(acc[mt][0][0], acc[mt][0][1], hi[0], lo[0]);
      split(acc[mt][0][2], acc[mt][0][3], hi[1], lo[1]);
      split(acc[mt][1][0], acc[mt][1][1], hi[2], lo[2]);
      split(acc[mt][1][2], acc[mt][1][3], hi[3], lo[3]);
      const int off = (mt * 8 + w) * kTileBytes + lane * 16;
      *reinterpret_cast<uint4*>(ws + kWsWHi + off) = {hi[0], hi[1], hi[2], hi[3]};
      *reinterpret_cast<uint4*>(ws + kWsWLo + off) = {lo[0], lo[1], lo[2], lo[3]};
    } else {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        *reinterpret_cast<float4*>(ws + kWsU + (mt * 16 + 2 * w + nt) * kTileBytes + lane * 16) =
            make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
  }
}

// grid (n_chunks, n_heads), block 320, dynamic shared memory kPrepSmemBytes.
__global__ void __launch_bounds__(kPrepThreads, 2) kda_tc_prepare_kernel(TcArgs x) {
  extern __shared__ float4 smem_f4[];
  const PrepSmem m = prep_smem(reinterpret_cast<uint8_t*>(smem_f4));
  const int64_t c = blockIdx.x;
  const int h = blockIdx.y, w = threadIdx.x / 32;
  const Chunk ch = chunk_at(x.plan, x.n_tokens, c);
  uint8_t* ws = x.ws + (c * x.n_heads + h) * static_cast<int64_t>(kWsBytes);
  prep_load(x, h, ch, m);
  // The 10 blocks (a, b), b <= a, of A / Aqk: pair p = a (a + 1) / 2 + b -> warp p; then the 32 qg / kg^T tiles.
  static_assert(kPrepThreads / 32 == 10, "one warp per block pair");
  {
    const int a = w >= 6 ? 3 : (w >= 3 ? 2 : (w >= 1 ? 1 : 0));
    prep_pair(a, w - a * (a + 1) / 2, m, ws);
  }
  for (int tile = w; tile < 32; tile += kPrepThreads / 32) prep_scaled_tiles(tile, m, ws);
  if (threadIdx.x < kDim) {
    reinterpret_cast<float*>(ws + kWsDecay)[threadIdx.x] = __expf(m.g[(kChunk - 1) * kGStride + threadIdx.x]);
  }
  __syncthreads();  // A complete; q is dead, T takes its place
  prep_inverse(m);  // ends with a barrier
  prep_tprime(m);   // likewise
  prep_wu<true>(m, ws);
  prep_wu<false>(m, ws);
}

}  // namespace

void launch_prepare(const TcArgs& x, cudaStream_t stream) {
  BG_CUDA_CHECK(
      cudaFuncSetAttribute(kda_tc_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPrepSmemBytes));
  const dim3 grid(static_cast<unsigned>(x.n_chunks), static_cast<unsigned>(x.n_heads));
  kda_tc_prepare_kernel<<<grid, kPrepThreads, kPrepSmemBytes, stream>>>(x);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops::kda_tc

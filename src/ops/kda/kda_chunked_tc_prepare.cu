// Kernel 1 of the tensor-core chunked KDA (kda_chunked_tc.cuh): per (chunk, head), the chunk-local operands W, U,
// qg, kg^T, Aqk and e^{G_last} into the workspace, from the chunk's q, k, v, g and beta alone.
#include "backend/cuda/cuda_check.h"
#include "ops/kda/kda_chunked_tc.cuh"

namespace bg::ops::kda_tc {
namespace {


struct PrepSmem {
  __nv_bfloat16* k;  // [64, 136]
  __nv_bfloat16* q;  // [64, 136]; after the A / qg phase, T [64, 68] fp32 lives here
  __nv_bfloat16* v;  // [64, 136]
  float* g;          // [64, 132] cumulative G
  float* a;          // [64, 68] A = diag(beta) strictly_lower(Kt)
  float* beta;       // [64]
  float* x;          // [16, 68] block-row scratch of the inverse
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
  // 16-byte pieces: thread tid copies piece tid % 16 of k, q and v rows tid / 16, + 20, ... and piece tid % 32 of g
  // rows tid / 32, + 10, ...; consecutive threads copy consecutive pieces of one row.
  const int64_t row_stride = static_cast<int64_t>(x.n_heads) * kDim;  // elements between two tokens' rows
  const int64_t first = (static_cast<int64_t>(ch.token_begin) * x.n_heads + h) * kDim;
  static_assert(kPrepThreads % 32 == 0 && kDim == 128, "16 bf16 pieces and 32 fp32 pieces a row");
  for (int i = tid / 16, c8 = (tid % 16) * 8; i < kChunk; i += kPrepThreads / 16) {
    const bool live = i < ch.n_tokens;
    const int64_t src = first + (live ? i : 0) * row_stride + c8;
    const int dst = i * kRowBf16 + c8;
    cp_async16(smem_addr(m.k + dst), x.in.k + src, live ? 16u : 0u);
    cp_async16(smem_addr(m.q + dst), x.in.q + src, live ? 16u : 0u);
    cp_async16(smem_addr(m.v + dst), x.in.v + src, live ? 16u : 0u);
  }
  for (int i = tid / 32, c4 = (tid % 32) * 4; i < kChunk; i += kPrepThreads / 32) {
    const bool live = i < ch.n_tokens;
    cp_async16(smem_addr(m.g + i * kGStride + c4), x.in.g + first + (live ? i : 0) * row_stride + c4, live ? 16u : 0u);
  }
  cp_async_commit();
  if (tid < kChunk) {
    m.beta[tid] = tid < ch.n_tokens ? x.in.beta[(static_cast<int64_t>(ch.token_begin) + tid) * x.n_heads + h] : 0.0f;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (tid < kDim) {  // 16 rows' values loaded at once (independent loads), then summed in order
    float run = 0.0f;
    for (int i0 = 0; i0 < kChunk; i0 += 16) {
      float v[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) v[u] = m.g[(i0 + u) * kGStride + tid];
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        run = i0 + u == 0 ? v[u] : run + v[u];
        m.g[(i0 + u) * kGStride + tid] = run;
      }
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
      const float f0 = exp_ftz(gi.x - gr.x), f1 = exp_ftz(gi.y - gr.y);
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
        split(kv.x * exp_ftz(gr.x - gj.x), kv.y * exp_ftz(gr.y - gj.y), bh[e / 2], bl[e / 2]);
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
      r[e / 2] = pack(qv.x * exp_ftz(gi.x), qv.y * exp_ftz(gi.y));
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
        x[u] = bf(m.k[j * kRowBf16 + d]) * exp_ftz(m.g[(kChunk - 1) * kGStride + d] - m.g[j * kGStride + d]);
      }
      split(x[0], x[1], hi[e / 2], lo[e / 2]);
    }
    *reinterpret_cast<uint4*>(ws + kWsKgHi + tile * kTileBytes + lane * 16) = {hi[0], hi[1], hi[2], hi[3]};
    *reinterpret_cast<uint4*>(ws + kWsKgLo + tile * kTileBytes + lane * 16) = {lo[0], lo[1], lo[2], lo[3]};
  }
}

// Block row a (rows 16a .. 16a + 15) of T, from the rows above it: X = A[a, 0:a] T[0:a, 0:a], then
// T[a, 0:a] = -T_aa X. Thread (row group rg, column col) computes rows 4rg .. 4rg + 3 of column col, reading four
// A (T_aa) values of a row with one float4; the sums run over every column of the block row in ascending order,
// where T's zeros above the diagonal add exact zeros.
template <int kA>
__device__ void prep_block_row(const PrepSmem& m) {
  constexpr int kN = 16 * kA;  // columns 0 .. kN - 1
  float* tm = m.t();
  const int tid = threadIdx.x, rg = tid / kN, col = tid % kN;
  if (tid < 4 * kN) {
    float acc[4] = {};
#pragma unroll
    for (int mm = 0; mm < kN; mm += 4) {
      float t[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) t[u] = tm[(mm + u) * kAStride + col];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float4 av = *reinterpret_cast<const float4*>(m.a + (kN + 4 * rg + r) * kAStride + mm);
        acc[r] = fmaf(av.x, t[0], acc[r]);
        acc[r] = fmaf(av.y, t[1], acc[r]);
        acc[r] = fmaf(av.z, t[2], acc[r]);
        acc[r] = fmaf(av.w, t[3], acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) m.x[(4 * rg + r) * kAStride + col] = acc[r];
  }
  __syncthreads();
  if (tid < 4 * kN) {
    float acc[4] = {};
#pragma unroll
    for (int mm = 0; mm < 16; mm += 4) {
      float xv[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) xv[u] = m.x[(mm + u) * kAStride + col];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float4 tv = *reinterpret_cast<const float4*>(tm + (kN + 4 * rg + r) * kAStride + kN + mm);
        acc[r] = fmaf(tv.x, xv[0], acc[r]);
        acc[r] = fmaf(tv.y, xv[1], acc[r]);
        acc[r] = fmaf(tv.z, xv[2], acc[r]);
        acc[r] = fmaf(tv.w, xv[3], acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) tm[(kN + 4 * rg + r) * kAStride + col] = -acc[r];
  }
  __syncthreads();
}

// T = (I + A)^-1 (unit lower triangular, fp32) by blocks of 16: the four diagonal blocks by forward substitution at
// once (thread 16b + j holds column j of block b in registers), then block row a = 1, 2, 3 in turn:
//   T[a, 0:a] = -T_aa (A[a, 0:a] T[0:a, 0:a])   (16 x 16a, reading only rows of earlier block rows).
__device__ void prep_inverse(const PrepSmem& m) {
  float* tm = m.t();
  static_assert(kAStride % 4 == 0, "float4 rows");
  for (int idx = threadIdx.x; idx < kChunk * kAStride / 4; idx += kPrepThreads) {  // zero (the diagonal comes next)
    reinterpret_cast<float4*>(tm)[idx] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  __syncthreads();
  if (threadIdx.x < 4 * 16) {  // warps 0, 1
    const int blk = 16 * (threadIdx.x / 16), j = threadIdx.x % 16;
    // Column j of the block: t[r] = [r == j] - sum_{mm < r} A[r, mm] t[mm] (zero above the diagonal).
    float t[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float* arow = m.a + (blk + r) * kAStride + blk;
      float acc = 0.0f;
#pragma unroll
      for (int mm = 0; mm < r; mm += 4) {
        const float4 av = *reinterpret_cast<const float4*>(arow + mm);
        acc = fmaf(av.x, t[mm], acc);
        if (mm + 1 < r) acc = fmaf(av.y, t[mm + 1], acc);
        if (mm + 2 < r) acc = fmaf(av.z, t[mm + 2], acc);
        if (mm + 3 < r) acc = fmaf(av.w, t[mm + 3], acc);
      }
      t[r] = r == j ? 1.0f : (r < j ? 0.0f : -acc);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) tm[(blk + r) * kAStride + blk + j] = t[r];
  }
  __syncthreads();
  prep_block_row<1>(m);
  prep_block_row<2>(m);
  prep_block_row<3>(m);
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
          split(bf(m.k[j0 * kRowBf16 + d]) * exp_ftz(m.g[j0 * kGStride + d]),
                bf(m.k[(j0 + 1) * kRowBf16 + d]) * exp_ftz(m.g[(j0 + 1) * kGStride + d]), bh[nt][e / 2], bl[nt][e / 2]);
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
    reinterpret_cast<float*>(ws + kWsDecay)[threadIdx.x] = exp_ftz(m.g[(kChunk - 1) * kGStride + threadIdx.x]);
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

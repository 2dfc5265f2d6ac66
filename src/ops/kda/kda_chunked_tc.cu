// Kernel 2 of the tensor-core chunked KDA (kda_chunked_tc.cuh) and the launchers: kda_chunked_cuda (one sequence)
// and kda_chunked_varlen_cuda (every chunked sequence of a step, one launch pair).
#include <cuda_bf16.h>

#include <cstdint>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/kda/kda_chunked_tc.cuh"
#include "ops/kda/kda_cuda.h"
#include "ops/kda/kda_varlen_plan.h"

namespace bg::ops {
namespace {

using namespace kda_tc;  // NOLINT: the workspace layout and primitives are this file's vocabulary

// ---- kernel 2: per (sequence, head), chunks in order ---------------------------------------------------------------

// Shared memory: the workspace parts A and B of the current chunk (copied verbatim), S as hi / lo bf16 [128, 136]
// (the B operand of step A) and v_new as hi / lo bf16 [64, 136] (the B operand of steps C and D).
constexpr int kRecSmemPartA = 0;
constexpr int kRecSmemPartB = kRecSmemPartA + kWsPartA;
constexpr int kRecSmemS = kRecSmemPartB + kWsPartBBytes;
constexpr int kRecSmemV = kRecSmemS + 2 * kDim * kRowBf16 * 2;
constexpr int kRecSmemBytes = kRecSmemV + 2 * kChunk * kRowBf16 * 2;
static_assert(kRecSmemBytes <= 232448, "over the 227 KiB a CTA may use");

__device__ __forceinline__ void copy_part(uint32_t dst, const uint8_t* src, int bytes) {
  for (int off = threadIdx.x * 16; off < bytes; off += kRecurThreads * 16) cp_async16(dst + off, src + off);
}

// Accumulator element e of a 16x8 tile -> (row + 8 (e >> 1), col + (e & 1)); pairs (e, e + 1) go out as one word.
__device__ __forceinline__ void store_split(__nv_bfloat16* hi, __nv_bfloat16* lo, int row, int col, const float* v) {
  uint32_t h0, l0, h1, l1;
  split(v[0], v[1], h0, l0);
  split(v[2], v[3], h1, l1);
  *reinterpret_cast<uint32_t*>(hi + row * kRowBf16 + col) = h0;
  *reinterpret_cast<uint32_t*>(lo + row * kRowBf16 + col) = l0;
  *reinterpret_cast<uint32_t*>(hi + (row + 8) * kRowBf16 + col) = h1;
  *reinterpret_cast<uint32_t*>(lo + (row + 8) * kRowBf16 + col) = l1;
}

// B fragments of n-tiles (2p, 2p + 1) for k-step ks from a row-major [k, n] bf16 matrix at column offset col0.
__device__ __forceinline__ void load_b(uint32_t (&r)[4], uint32_t base, int ks, int col0, int lane) {
  const int mat = lane / 8, row = 16 * ks + 8 * (mat % 2) + lane % 8, col = col0 + 8 * (mat / 2);
  ldmatrix_x4_trans(r, base + (row * kRowBf16 + col) * 2);
}

__device__ __forceinline__ void load_a(uint32_t (&r)[4], const uint8_t* tile, int lane) {
  const uint4 v = *reinterpret_cast<const uint4*>(tile + lane * 16);
  r[0] = v.x;
  r[1] = v.y;
  r[2] = v.z;
  r[3] = v.w;
}

// One warp of the recurrence kernel: row tile rt = w % 4 (tokens 16 rt .. of v_new and o; state rows 32 rt ..),
// value quarter cq = w / 4 (columns 32 cq ..), and the shared-memory buffers.
struct RecWarp {
  const uint8_t* part_a;  // workspace part A of the current chunk (W, qg, U, e^{G_last})
  const uint8_t* part_b;  // workspace part B (kg^T, Aqk)
  __nv_bfloat16 *s_hi, *s_lo, *v_hi, *v_lo;
  uint32_t s_hi_u, s_lo_u, v_hi_u, v_lo_u;  // the same, as shared-memory addresses
  int lane, rt, cq, g, t;
};

// State rows 32 rt + 16 mi + g (+8), columns 32 cq + 8 ni + 2t (+1), in accumulator layout: from / to global memory.
__device__ __forceinline__ void rec_load_state(const RecWarp& r, const float* state, float (&s)[2][4][4]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int row = 32 * r.rt + 16 * mi + r.g, col = 32 * r.cq + 8 * ni + 2 * r.t;
      const float2 lo = *reinterpret_cast<const float2*>(state + row * kDim + col);
      const float2 hi = *reinterpret_cast<const float2*>(state + (row + 8) * kDim + col);
      s[mi][ni][0] = lo.x;
      s[mi][ni][1] = lo.y;
      s[mi][ni][2] = hi.x;
      s[mi][ni][3] = hi.y;
      store_split(r.s_hi, r.s_lo, row, col, s[mi][ni]);
    }
  }
}
__device__ __forceinline__ void rec_store_state(const RecWarp& r, float* state, const float (&s)[2][4][4]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int row = 32 * r.rt + 16 * mi + r.g, col = 32 * r.cq + 8 * ni + 2 * r.t;
      *reinterpret_cast<float2*>(state + row * kDim + col) = make_float2(s[mi][ni][0], s[mi][ni][1]);
      *reinterpret_cast<float2*>(state + (row + 8) * kDim + col) = make_float2(s[mi][ni][2], s[mi][ni][3]);
    }
  }
}

// Step A: vn = W S and o = qg S for this warp's rows and columns (K = 128); then v_new = U - W S into shared
// memory (hi / lo), leaving v_new in vn.
__device__ __forceinline__ void rec_step_a(const RecWarp& r, float (&vn)[4][4], float (&o)[4][4]) {
#pragma unroll 2
  for (int ks = 0; ks < kDim / 16; ++ks) {
    uint32_t wh[4], wl[4], qg[4];
    load_a(wh, r.part_a + kWsWHi + (r.rt * 8 + ks) * kTileBytes, r.lane);
    load_a(wl, r.part_a + kWsWLo + (r.rt * 8 + ks) * kTileBytes, r.lane);
    load_a(qg, r.part_a + kWsQg + (r.rt * 8 + ks) * kTileBytes, r.lane);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      uint32_t bh[4], bl[4];
      load_b(bh, r.s_hi_u, ks, 32 * r.cq + 16 * p, r.lane);
      load_b(bl, r.s_lo_u, ks, 32 * r.cq + 16 * p, r.lane);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mma3(vn[2 * p + u], wh, wl, bh[2 * u], bh[2 * u + 1], bl[2 * u], bl[2 * u + 1]);
        mma(o[2 * p + u], qg, bh[2 * u], bh[2 * u + 1]);
        mma(o[2 * p + u], qg, bl[2 * u], bl[2 * u + 1]);
      }
    }
  }
#pragma unroll
  for (int ni = 0; ni < 4; ++ni) {
    const float4 u =
        *reinterpret_cast<const float4*>(r.part_a + kWsU + (r.rt * 16 + 4 * r.cq + ni) * kTileBytes + r.lane * 16);
    vn[ni][0] = u.x - vn[ni][0];
    vn[ni][1] = u.y - vn[ni][1];
    vn[ni][2] = u.z - vn[ni][2];
    vn[ni][3] = u.w - vn[ni][3];
    store_split(r.v_hi, r.v_lo, 16 * r.rt + r.g, 32 * r.cq + 8 * ni + 2 * r.t, vn[ni]);
  }
}

// Step C: o += Aqk v_new over the column blocks ks <= rt, then out (rows < n only).
__device__ __forceinline__ void rec_step_c(const RecWarp& r, float (&o)[4][4], const TcArgs& x, Chunk ch, int h) {
#pragma unroll 1
  for (int ks = 0; ks <= r.rt; ++ks) {
    uint32_t a[4];
    load_a(a, r.part_b + (kWsAqk - kWsPartA) + (r.rt * 4 + ks) * kTileBytes, r.lane);
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      uint32_t bh[4], bl[4];
      load_b(bh, r.v_hi_u, ks, 32 * r.cq + 16 * p, r.lane);
      load_b(bl, r.v_lo_u, ks, 32 * r.cq + 16 * p, r.lane);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mma(o[2 * p + u], a, bh[2 * u], bh[2 * u + 1]);
        mma(o[2 * p + u], a, bl[2 * u], bl[2 * u + 1]);
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = 16 * r.rt + r.g + 8 * half;
    if (i >= ch.n_tokens) continue;
    __nv_bfloat16* orow =
        x.out + (static_cast<int64_t>(ch.token_begin + i) * x.n_heads + h) * kDim + 32 * r.cq + 2 * r.t;
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      *reinterpret_cast<__nv_bfloat162*>(orow + 8 * ni) = __floats2bfloat162_rn(o[ni][2 * half], o[ni][2 * half + 1]);
    }
  }
}

// Step D: S <- e^{G_last} o S + kg^T v_new (K = 64 tokens) on the accumulators.
__device__ __forceinline__ void rec_step_d(const RecWarp& r, float (&s)[2][4][4], const float (&decay)[2][2]) {
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      s[mi][ni][0] *= decay[mi][0];
      s[mi][ni][1] *= decay[mi][0];
      s[mi][ni][2] *= decay[mi][1];
      s[mi][ni][3] *= decay[mi][1];
    }
  }
#pragma unroll 1
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t bh[2][4], bl[2][4];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      load_b(bh[p], r.v_hi_u, ks, 32 * r.cq + 16 * p, r.lane);
      load_b(bl[p], r.v_lo_u, ks, 32 * r.cq + 16 * p, r.lane);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      uint32_t kh[4], kl[4];
      load_a(kh, r.part_b + (kWsKgHi - kWsPartA) + ((2 * r.rt + mi) * 4 + ks) * kTileBytes, r.lane);
      load_a(kl, r.part_b + (kWsKgLo - kWsPartA) + ((2 * r.rt + mi) * 4 + ks) * kTileBytes, r.lane);
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        mma3(s[mi][ni], kh, kl, bh[ni / 2][2 * (ni % 2)], bh[ni / 2][2 * (ni % 2) + 1], bl[ni / 2][2 * (ni % 2)],
             bl[ni / 2][2 * (ni % 2) + 1]);
      }
    }
  }
}

// grid (n_seqs, n_heads), block 512 (16 warps, see RecWarp), kRecSmemBytes. Per chunk: step A, v_new out, barrier,
// next part A in, step C, step D, barrier, next part B in, S (hi / lo) out; part B of chunk c streams in during step A
// of chunk c, part A of chunk c + 1 during steps C and D of chunk c.
__global__ void __launch_bounds__(kRecurThreads, 1) kda_tc_recurrence_kernel(TcArgs x) {
  extern __shared__ float4 smem_f4[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(smem_f4);
  RecWarp r;
  r.part_a = smem + kRecSmemPartA;
  r.part_b = smem + kRecSmemPartB;
  r.s_hi = reinterpret_cast<__nv_bfloat16*>(smem + kRecSmemS);
  r.s_lo = r.s_hi + kDim * kRowBf16;
  r.v_hi = reinterpret_cast<__nv_bfloat16*>(smem + kRecSmemV);
  r.v_lo = r.v_hi + kChunk * kRowBf16;
  r.s_hi_u = smem_addr(r.s_hi);
  r.s_lo_u = smem_addr(r.s_lo);
  r.v_hi_u = smem_addr(r.v_hi);
  r.v_lo_u = smem_addr(r.v_lo);
  const int w = threadIdx.x / 32;
  r.lane = threadIdx.x % 32;
  r.rt = w % 4;
  r.cq = w / 4;
  r.g = r.lane / 4;
  r.t = r.lane % 4;
  const int h = blockIdx.y;

  int64_t chunk0 = 0, n_chunks = x.n_chunks, slot = 0;
  if (x.plan != nullptr) {
    const int32_t* sd = x.plan + 2 * x.n_chunks + 4 * static_cast<int64_t>(blockIdx.x);
    chunk0 = sd[0];
    n_chunks = sd[1];
    slot = sd[2];
  }
  float* state = x.state_base + slot * x.slot_stride + static_cast<int64_t>(h) * kDim * kDim;
  auto ws_of = [&](int64_t c) { return x.ws + (c * x.n_heads + h) * static_cast<int64_t>(kWsBytes); };

  float s[2][4][4];
  rec_load_state(r, state, s);
  copy_part(smem_addr(smem + kRecSmemPartA), ws_of(chunk0), kWsPartA);
  cp_async_commit();
  copy_part(smem_addr(smem + kRecSmemPartB), ws_of(chunk0) + kWsPartA, kWsPartBBytes);
  cp_async_commit();
#pragma unroll 1
  for (int64_t cc = 0; cc < n_chunks; ++cc) {
    const Chunk ch = chunk_at(x.plan, x.n_tokens, chunk0 + cc);
    cp_async_wait<1>();  // part A of this chunk (part B may still be in flight)
    __syncthreads();
    float decay[2][2];  // e^{G_last} of this warp's state rows, read before part A is overwritten
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      decay[mi][0] = reinterpret_cast<const float*>(r.part_a + kWsDecay)[32 * r.rt + 16 * mi + r.g];
      decay[mi][1] = reinterpret_cast<const float*>(r.part_a + kWsDecay)[32 * r.rt + 16 * mi + r.g + 8];
    }
    float vn[4][4] = {}, o[4][4] = {};
    rec_step_a(r, vn, o);
    __syncthreads();  // part A and S are read; v_new is complete
    if (cc + 1 < n_chunks) copy_part(smem_addr(smem + kRecSmemPartA), ws_of(chunk0 + cc + 1), kWsPartA);
    cp_async_commit();
    cp_async_wait<1>();  // part B of this chunk
    __syncthreads();
    rec_step_c(r, o, x, ch, h);
    rec_step_d(r, s, decay);
    __syncthreads();  // part B and v_new are read
    if (cc + 1 < n_chunks) copy_part(smem_addr(smem + kRecSmemPartB), ws_of(chunk0 + cc + 1) + kWsPartA, kWsPartBBytes);
    cp_async_commit();
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        store_split(r.s_hi, r.s_lo, 32 * r.rt + 16 * mi + r.g, 32 * r.cq + 8 * ni + 2 * r.t, s[mi][ni]);
      }
    }
  }
  rec_store_state(r, state, s);
}

void launch_tc(const TcArgs& x, int64_t n_seqs, cudaStream_t stream) {
  launch_prepare(x, stream);
  BG_CUDA_CHECK(
      cudaFuncSetAttribute(kda_tc_recurrence_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRecSmemBytes));
  const dim3 grid2(static_cast<unsigned>(n_seqs), static_cast<unsigned>(x.n_heads));
  kda_tc_recurrence_kernel<<<grid2, kRecurThreads, kRecSmemBytes, stream>>>(x);
  BG_CUDA_CHECK_LAUNCH();
}

bool tc_dims(const KdaParams& p) { return p.head_dim_k == kDim && p.head_dim_v == kDim; }

void check_common(const char* op, const KdaParams& p, const KdaCudaInputs& in, const __nv_bfloat16* out) {
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens <= std::numeric_limits<int32_t>::max(), "{}: n_tokens {} out of range", op,
           p.n_tokens);
  BG_CHECK(p.n_heads > 0 && p.n_heads <= 65535, "{}: n_heads {} out of range", op, p.n_heads);
  BG_CHECK(p.head_dim_k >= 1 && p.head_dim_k <= kKdaCudaMaxHeadDim && p.head_dim_v >= 1 &&
               p.head_dim_v <= kKdaCudaMaxHeadDim,
           "{}: head dims k={} v={} unsupported (each must be in [1, {}])", op, p.head_dim_k, p.head_dim_v,
           kKdaCudaMaxHeadDim);
  if (p.n_tokens == 0) return;
  BG_CHECK(in.q && in.k && in.v && in.g && in.beta && out, "{}: null input/output pointer with n_tokens {}", op,
           p.n_tokens);
  if (!tc_dims(p)) return;
  BG_CHECK(cuda::aligned_to(in.q, 16) && cuda::aligned_to(in.k, 16) && cuda::aligned_to(in.v, 16) &&
               cuda::aligned_to(out, 4),
           "{}: q / k / v must be 16-byte aligned and out 4-byte aligned (q {}, k {}, v {}, out {})", op,
           static_cast<const void*>(in.q), static_cast<const void*>(in.k), static_cast<const void*>(in.v),
           static_cast<const void*>(out));
}

void check_workspace(const char* op, const KdaWorkspace& ws, size_t need) {
  BG_CHECK(ws.ptr != nullptr && ws.bytes >= need, "{}: workspace of {} bytes at {} < the {} bytes needed", op, ws.bytes,
           ws.ptr, need);
  BG_CHECK(cuda::aligned_to(ws.ptr, 16), "{}: workspace {} not 16-byte aligned", op, ws.ptr);
}

}  // namespace

int64_t kda_chunk_count(int64_t n_tokens) { return (n_tokens + kChunk - 1) / kChunk; }

size_t kda_chunked_workspace_bytes(const KdaParams& p, int64_t n_chunks) {
  if (!tc_dims(p) || n_chunks <= 0) return 0;
  return static_cast<size_t>(n_chunks) * static_cast<size_t>(p.n_heads) * kWsBytes;
}

void kda_chunked_cuda(const KdaParams& p, const KdaCudaInputs& in, float* state, __nv_bfloat16* out, KdaWorkspace ws,
                      cudaStream_t stream) {
  constexpr const char* op = "kda_chunked_cuda";
  check_common(op, p, in, out);
  BG_CHECK(state != nullptr, "{}: state is null", op);
  if (p.n_tokens == 0) return;
  if (!tc_dims(p)) {
    kda_chunked_simt_cuda(p, in, state, out, stream);
    return;
  }
  const int64_t n_chunks = kda_chunk_count(p.n_tokens);
  check_workspace(op, ws, kda_chunked_workspace_bytes(p, n_chunks));
  TcArgs x{in,    out, static_cast<uint8_t*>(ws.ptr), nullptr, p.n_tokens, n_chunks,
           state, 0,   static_cast<int>(p.n_heads)};
  launch_tc(x, 1, stream);
}

void kda_chunked_varlen_cuda(const KdaParams& p, const KdaCudaInputs& in, const KdaVarlenBatch& batch,
                             __nv_bfloat16* out, KdaWorkspace ws, cudaStream_t stream) {
  constexpr const char* op = "kda_chunked_varlen_cuda";
  check_common(op, p, in, out);
  BG_CHECK(batch.plan != nullptr, "{}: no plan", op);
  const KdaVarlenPlan& plan = *batch.plan;
  if (plan.n_seqs() == 0) return;
  BG_CHECK(batch.state_base != nullptr, "{}: state_base is null", op);
  BG_CHECK(batch.slot_stride >= p.n_heads * p.head_dim_k * p.head_dim_v, "{}: slot_stride {} < one state of {} floats",
           op, batch.slot_stride, p.n_heads * p.head_dim_k * p.head_dim_v);
  const KdaChunkDesc& last = plan.chunks.back();
  BG_CHECK(static_cast<int64_t>(last.token_begin) + last.n_tokens <= p.n_tokens,
           "{}: the plan reaches token {} of {} rows", op, static_cast<int64_t>(last.token_begin) + last.n_tokens,
           p.n_tokens);
  BG_CHECK(plan.n_seqs() <= std::numeric_limits<int32_t>::max() && plan.n_chunks() <= (int64_t{1} << 31) - 1,
           "{}: {} sequences / {} chunks too many", op, plan.n_seqs(), plan.n_chunks());
  if (!tc_dims(p)) {
    // The CUDA-core kernel, one launch per sequence (the host plan has every offset).
    const int64_t qk = p.n_heads * p.head_dim_k, vd = p.n_heads * p.head_dim_v;
    for (const KdaSeqDesc& s : plan.seqs) {
      const KdaChunkDesc& first = plan.chunks[static_cast<size_t>(s.chunk_begin)];
      const KdaChunkDesc& end = plan.chunks[static_cast<size_t>(s.chunk_begin + s.n_chunks - 1)];
      const int64_t b = first.token_begin;
      KdaParams ps = p;
      ps.n_tokens = static_cast<int64_t>(end.token_begin) + end.n_tokens - b;
      const KdaCudaInputs sub{in.q + b * qk, in.k + b * qk, in.v + b * vd, in.g + b * qk, in.beta + b * p.n_heads};
      kda_chunked_simt_cuda(ps, sub, batch.state_base + s.slot * batch.slot_stride, out + b * vd, stream);
    }
    return;
  }
  BG_CHECK(batch.plan_dev != nullptr, "{}: the device copy of the plan is null", op);
  for (const KdaChunkDesc& c : plan.chunks) {
    BG_CHECK(c.n_tokens >= 1 && c.n_tokens <= kChunk, "{}: a chunk of {} tokens (plan chunk size must be {})", op,
             c.n_tokens, kChunk);
  }
  check_workspace(op, ws, kda_chunked_workspace_bytes(p, plan.n_chunks()));
  TcArgs x{in,
           out,
           static_cast<uint8_t*>(ws.ptr),
           batch.plan_dev,
           p.n_tokens,
           plan.n_chunks(),
           batch.state_base,
           batch.slot_stride,
           static_cast<int>(p.n_heads)};
  launch_tc(x, plan.n_seqs(), stream);
}

}  // namespace bg::ops

// The dense decode GEMM: y[n, out] = x[n, in] W^T for bf16 W and 1..64 tokens, a weight-streaming tensor-core kernel
// (docs/PERF.md, "Dense decode GEMM"). Each CTA of 8 warps owns a tile of 128 or 256 weight rows (16 or 32 per warp,
// the M of mma.m16n8k16) and all the tokens (N, 1-8 n8 blocks) over one k-split of the input; every 64-input stage of
// weights and activations is one cp.async group into a 128-byte-swizzled shared tile, read by ldmatrix, 4-5 stages in
// flight. A tile split over k stores each split's fp32 sums in its own slot; the split whose arrival completes the
// tile adds the slots in split order (deterministic: the same bits whoever arrives last) and writes y.
#include <cuda_bf16.h>

#include <mutex>
#include <span>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/elementwise/cuda_ptx.cuh"
#include "ops/elementwise/elementwise.h"
#include "ops/linear/linear_cuda.h"
#include "ops/linear/linear_decode_plan.h"

namespace bg::ops {
namespace {

using ptx::atomic_add_acq_rel;
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x2;
using ptx::ldmatrix_x4;
using ptx::mma_bf16_16816;
using ptx::smem_addr;

constexpr int kThreads = 256;
constexpr int kRowBytes = kDenseDecodeStageK * 2;  // one swizzled shared row: 64 bf16 = 8 chunks of 16 bytes

struct Part {
  int64_t col0, cols;
  __nv_bfloat16* dst;
};

struct DecodeArgs {
  const __nv_bfloat16* w;
  const __nv_bfloat16* x;
  void* y;
  int64_t n_out, n_in;
  int n_tokens, splits, stages;
  bool out_f32, accumulate;
  float* partials;
  int32_t* counters;
  int n_parts;  // > 0: y is split into these column parts (bf16, no accumulate) instead of written whole
  Part parts[kMaxColumnSlices];
};

template <int MT, int NB>
struct Geometry {
  static constexpr int kRows = 128 * MT;
  static constexpr int kStages = MT == 2 ? 5 : 4;
  static constexpr int kWBytes = kRows * kRowBytes;
  static constexpr int kXRows = 8 * NB;
  static constexpr int kXBytes = kXRows * kRowBytes;
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static constexpr int kWChunks = kRows * 8 / kThreads;  // 16-byte weight chunks per thread and stage (4 or 8)
  static constexpr int kXChunks = kXRows * 8;            // activation chunks per stage (64..512)
  static constexpr int kSlotFloats = kRows * kXRows;
};

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte rows: chunk c ^ (r mod 8), so the 8 rows an ldmatrix
// phase reads (one chunk column) fall in 8 different bank groups, and so do a warp's cp.async writes.
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return static_cast<uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
}

template <int MT, int NB>
__global__ void __launch_bounds__(kThreads, MT == 2 ? 1 : 2) dense_decode_kernel(DecodeArgs a) {
  using G = Geometry<MT, NB>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_last;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int tile = static_cast<int>(blockIdx.x) / a.splits, split = static_cast<int>(blockIdx.x) % a.splits;
  const int64_t row0 = static_cast<int64_t>(tile) * G::kRows;
  const int st0 = static_cast<int>(static_cast<int64_t>(a.stages) * split / a.splits);
  const int n_st = static_cast<int>(static_cast<int64_t>(a.stages) * (split + 1) / a.splits) - st0;
  const uint32_t base = smem_addr(smem);

  // Producer: this thread's weight chunks (rows past n_out are zero-filled from row 0's address) and activation chunk
  // (tokens past n_tokens likewise), stepped by one stage per copy.
  const __nv_bfloat16* w_src[G::kWChunks];
  uint32_t w_dst[G::kWChunks], w_bytes[G::kWChunks];
#pragma unroll
  for (int i = 0; i < G::kWChunks; ++i) {
    const int q = tid + i * kThreads, r = q >> 3, c = q & 7;
    const bool ok = row0 + r < a.n_out;
    w_src[i] = a.w + (ok ? row0 + r : 0) * a.n_in + static_cast<int64_t>(st0) * kDenseDecodeStageK + c * 8;
    w_dst[i] = swizzled(r, c);
    w_bytes[i] = ok ? 16u : 0u;
  }
  constexpr int kXPer = (G::kXChunks + kThreads - 1) / kThreads;
  const __nv_bfloat16* x_src[kXPer];
  uint32_t x_dst[kXPer], x_bytes[kXPer];
#pragma unroll
  for (int i = 0; i < kXPer; ++i) {
    const int q = tid + i * kThreads, r = q >> 3, c = q & 7;
    const bool ok = q < G::kXChunks && r < a.n_tokens;
    x_src[i] = a.x + (ok ? r : 0) * a.n_in + static_cast<int64_t>(st0) * kDenseDecodeStageK + c * 8;
    x_dst[i] = G::kWBytes + swizzled(r, c);
    x_bytes[i] = ok ? 16u : 0u;
  }
  auto load_stage = [&](int buf) {
    const uint32_t b = base + static_cast<uint32_t>(buf * G::kStageBytes);
#pragma unroll
    for (int i = 0; i < G::kWChunks; ++i) {
      cp_async16(b + w_dst[i], w_src[i], w_bytes[i]);
      w_src[i] += kDenseDecodeStageK;
    }
#pragma unroll
    for (int i = 0; i < kXPer; ++i) {
      if (tid + i * kThreads < G::kXChunks) cp_async16(b + x_dst[i], x_src[i], x_bytes[i]);
      x_src[i] += kDenseDecodeStageK;
    }
  };

  float acc[MT][NB][4] = {};

  // ldmatrix lanes: A (16 x 16 of rows x k) matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) give a0..a3; B (k16 x n8
  // twice) matrices (block j, k 0-7 | 8-15), (block j + 1, ...) give b0, b1 of two n8 blocks.
  const int a_row = warp * 16 * MT + (lane & 15), a_chunk = lane >> 4;
  const int b_row = ((lane >> 4) << 3) + (lane & 7), b_chunk = (lane >> 3) & 1;
  auto compute_stage = [&](int buf) {
    const uint32_t wb = base + static_cast<uint32_t>(buf * G::kStageBytes), xb = wb + G::kWBytes;
#pragma unroll
    for (int kk = 0; kk < kDenseDecodeStageK / 16; ++kk) {
      uint32_t af[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) ldmatrix_x4(af[m], wb + swizzled(a_row + 16 * m, 2 * kk + a_chunk));
      if constexpr (NB == 1) {
        uint32_t bf[2];
        ldmatrix_x2(bf, xb + swizzled(lane & 7, 2 * kk + b_chunk));
#pragma unroll
        for (int m = 0; m < MT; ++m) mma_bf16_16816(acc[m][0], af[m], bf[0], bf[1]);
      } else {
#pragma unroll
        for (int jp = 0; jp < NB / 2; ++jp) {
          uint32_t bf[4];
          ldmatrix_x4(bf, xb + swizzled(16 * jp + b_row, 2 * kk + b_chunk));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_bf16_16816(acc[m][2 * jp], af[m], bf[0], bf[1]);
            mma_bf16_16816(acc[m][2 * jp + 1], af[m], bf[2], bf[3]);
          }
        }
      }
    }
  };

#pragma unroll
  for (int s = 0; s < G::kStages - 1; ++s) {
    if (s < n_st) load_stage(s);
    cp_async_commit();
  }
  for (int st = 0; st < n_st; ++st) {
    cp_async_wait<G::kStages - 2>();
    __syncthreads();  // stage st is in; every warp is done with the buffer refilled below (computed at st - 1)
    if (st + G::kStages - 1 < n_st) load_stage((st + G::kStages - 1) % G::kStages);
    cp_async_commit();
    compute_stage(st % G::kStages);
  }

  if (a.splits > 1) {
    // Fragment order: thread tid's float4 of (m, j) at ((m * NB + j) * 256 + tid) * 4, coalesced.
    float* slot = a.partials + (static_cast<int64_t>(tile) * a.splits + split) * G::kSlotFloats;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        *reinterpret_cast<float4*>(slot + ((m * NB + j) * kThreads + tid) * 4) =
            make_float4(acc[m][j][0], acc[m][j][1], acc[m][j][2], acc[m][j][3]);
      }
    __syncthreads();  // the CTA's slot is written before thread 0's arrival releases it
    if (tid == 0) s_last = atomic_add_acq_rel(&a.counters[tile], 1) == a.splits - 1;
    __syncthreads();
    if (!s_last) return;
    if (tid == 0) a.counters[tile] = 0;  // for the next launch (stream-ordered)
    // ((p_0 + p_1) + ...) in split order, this split's sums from registers (the same values it stored).
    float sum[MT][NB][4] = {};
#pragma unroll 1
    for (int sp = 0; sp < a.splits; ++sp) {
      const float* src = a.partials + (static_cast<int64_t>(tile) * a.splits + sp) * G::kSlotFloats;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < NB; ++j) {
          const float4 v = sp == split
                               ? make_float4(acc[m][j][0], acc[m][j][1], acc[m][j][2], acc[m][j][3])
                               : __ldcg(reinterpret_cast<const float4*>(src + ((m * NB + j) * kThreads + tid) * 4));
          sum[m][j][0] += v.x;
          sum[m][j][1] += v.y;
          sum[m][j][2] += v.z;
          sum[m][j][3] += v.w;
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][j][e] = sum[m][j][e];
  }

  // acc[m][j]: rows (g, g + 8) of the warp's m16 tile m, tokens 8j + 2t + {0, 1}; y is [n_tokens, n_out].
  const int g = lane >> 2, t = lane & 3;
  if (a.n_parts > 0) {
    // Output column `row` of token tok goes to its part's [n_tokens, cols] matrix.
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + warp * 16 * MT + 16 * m + g + h * 8;
        if (row >= a.n_out) continue;
        int i = 0;
        while (i + 1 < a.n_parts && row >= a.parts[i + 1].col0) ++i;
        const Part& pt = a.parts[i];
#pragma unroll
        for (int j = 0; j < NB; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = 8 * j + 2 * t + e;
            if (tok < a.n_tokens) pt.dst[tok * pt.cols + (row - pt.col0)] = __float2bfloat16_rn(acc[m][j][2 * h + e]);
          }
      }
    return;
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = row0 + warp * 16 * MT + 16 * m + g + (e >> 1) * 8;
        const int tok = 8 * j + 2 * t + (e & 1);
        if (row >= a.n_out || tok >= a.n_tokens) continue;
        const int64_t o = static_cast<int64_t>(tok) * a.n_out + row;
        float v = acc[m][j][e];
        if (a.out_f32) {
          float* y = static_cast<float*>(a.y);
          y[o] = a.accumulate ? y[o] + v : v;
        } else {
          __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.y);
          if (a.accumulate) v += __bfloat162float(y[o]);
          y[o] = __float2bfloat16_rn(v);
        }
      }
}

int current_device() {
  int dev = 0;
  BG_CUDA_CHECK(cudaGetDevice(&dev));
  BG_CHECK(dev >= 0 && dev < 64, "dense_decode_cuda: device {} out of range", dev);
  return dev;
}

// The shared-memory opt-in is per device (ranks of one process run on several).
template <int MT, int NB>
void launch(const DecodeArgs& args, int64_t ctas, int dev, cudaStream_t stream) {
  using G = Geometry<MT, NB>;
  static std::mutex mu;
  static uint64_t done = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if ((done >> dev & 1) == 0) {
      BG_CUDA_CHECK(cudaFuncSetAttribute(dense_decode_kernel<MT, NB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         G::kSmemBytes));
      done |= uint64_t{1} << dev;
    }
  }
  dense_decode_kernel<MT, NB><<<static_cast<unsigned>(ctas), kThreads, G::kSmemBytes, stream>>>(args);
  BG_CUDA_CHECK_LAUNCH();
}

int sm_count(int dev) {
  static std::mutex mu;
  static int sms[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (sms[dev] == 0) BG_CUDA_CHECK(cudaDeviceGetAttribute(&sms[dev], cudaDevAttrMultiProcessorCount, dev));
  return sms[dev];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

size_t dense_decode_workspace_bytes() {
  return kDenseDecodePartialBytes + static_cast<size_t>(kDenseDecodeCounters) * sizeof(int32_t);
}

DenseDecodeWorkspace dense_decode_workspace(void* buffer) {
  BG_CHECK(buffer != nullptr && aligned16(buffer), "dense_decode_workspace: null or unaligned buffer");
  DenseDecodeWorkspace ws;
  ws.partials = static_cast<float*>(buffer);
  ws.partial_bytes = kDenseDecodePartialBytes;
  ws.counters = reinterpret_cast<int32_t*>(static_cast<char*>(buffer) + kDenseDecodePartialBytes);
  ws.n_counters = kDenseDecodeCounters;
  return ws;
}

void dense_decode_workspace_init(const DenseDecodeWorkspace& ws, cudaStream_t stream) {
  BG_CHECK(ws.counters != nullptr, "dense_decode_workspace_init: no counters");
  BG_CUDA_CHECK(cudaMemsetAsync(ws.counters, 0, static_cast<size_t>(ws.n_counters) * sizeof(int32_t), stream));
}

bool dense_decode_enabled() {
  static const bool on = env_switch("BG_LINEAR_DECODE", false);
  return on;
}

int dense_decode_forced_splits() {
  static const int n = static_cast<int>(env_int("BG_LINEAR_DECODE_SPLITS", 1, 64).value_or(0));
  return n;
}

bool dense_decode_applies(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x,
                          const LinearCudaContext& ctx) {
  return w.format == WeightFormat::kDense && ctx.dense_decode != nullptr && ctx.dense_decode->partials != nullptr &&
         !p.deterministic && p.n_tokens >= 1 && p.n_tokens <= kDenseDecodeMaxTokens &&
         w.n_in % kDenseDecodeStageK == 0 && aligned16(w.data) && aligned16(x);
}

namespace {

void run_dense_decode(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                      std::span<const ColumnSlice> parts, const DenseDecodeWorkspace& ws, cudaStream_t stream) {
  BG_CHECK(w.format == WeightFormat::kDense && w.data != nullptr && w.n_out > 0 && w.n_in > 0,
           "dense_decode_cuda: needs a non-empty dense weight");
  BG_CHECK(p.n_tokens >= 1 && p.n_tokens <= kDenseDecodeMaxTokens, "dense_decode_cuda: {} tokens (1..{})", p.n_tokens,
           kDenseDecodeMaxTokens);
  BG_CHECK(w.n_in % kDenseDecodeStageK == 0, "dense_decode_cuda: input dim {} is not a multiple of {}", w.n_in,
           kDenseDecodeStageK);
  BG_CHECK(aligned16(w.data) && aligned16(x), "dense_decode_cuda: weight or input not 16-byte aligned");
  BG_CHECK(ws.partials != nullptr && ws.counters != nullptr, "dense_decode_cuda: no workspace");
  BG_CHECK(y != nullptr || !parts.empty(), "dense_decode_cuda: null y");
  const int dev = current_device();
  const DenseDecodePlan plan = dense_decode_plan(w.n_out, w.n_in, p.n_tokens, sm_count(dev), ws.partial_bytes,
                                                 ws.n_counters, dense_decode_forced_splits());
  const int64_t ctas = plan.tiles * plan.splits;
  BG_CHECK(ctas <= INT32_MAX && plan.stages <= INT32_MAX, "dense_decode_cuda: [{}, {}] too large", w.n_out, w.n_in);
  DecodeArgs args{static_cast<const __nv_bfloat16*>(w.data),
                  x,
                  y,
                  w.n_out,
                  w.n_in,
                  static_cast<int>(p.n_tokens),
                  plan.splits,
                  static_cast<int>(plan.stages),
                  p.out_type == LinearOutType::kF32,
                  p.accumulate,
                  ws.partials,
                  ws.counters,
                  static_cast<int>(parts.size()),
                  {}};
  for (size_t i = 0; i < parts.size(); ++i) {
    args.parts[i] = {parts[i].col0, parts[i].cols, static_cast<__nv_bfloat16*>(parts[i].dst)};
  }
  switch (plan.nb) {
    case 1:
      return launch<1, 1>(args, ctas, dev, stream);
    case 2:
      return launch<1, 2>(args, ctas, dev, stream);
    case 4:
      return launch<1, 4>(args, ctas, dev, stream);
    default:
      return launch<2, 8>(args, ctas, dev, stream);
  }
}

}  // namespace

void dense_decode_cuda(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                       const DenseDecodeWorkspace& ws, cudaStream_t stream) {
  run_dense_decode(p, w, x, y, {}, ws, stream);
}

void dense_decode_parts_cuda(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x,
                             std::span<const ColumnSlice> parts, const DenseDecodeWorkspace& ws, cudaStream_t stream) {
  BG_CHECK(p.out_type == LinearOutType::kBf16 && !p.accumulate && !parts.empty(),
           "dense_decode_parts_cuda: bf16 parts, written not accumulated");
  check_column_slices(p.n_tokens, w.n_out, w.data, parts, "dense_decode_parts_cuda");
  int64_t col = 0;
  for (const ColumnSlice& s : parts) {
    BG_CHECK(s.col0 == col && s.cols > 0, "dense_decode_parts_cuda: parts must tile the columns in order");
    col += s.cols;
  }
  BG_CHECK(col == w.n_out, "dense_decode_parts_cuda: parts cover {} of {} columns", col, w.n_out);
  run_dense_decode(p, w, x, nullptr, parts, ws, stream);
}

}  // namespace bg::ops

// The W4A16 expert kernel's launch arguments and its epilogues: gate/up's GLU into h; down's y, rows out and the
// weighted combine (fused into the down launch, or the per-token sum of the separate combine kernel). Device code in
// namespace w4 like moe_w4a16_device.cuh; included only by moe_w4a16_cuda.cu (which holds the kernels, the split-K
// reduction and the launches).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_device.cuh"
#include "ops/moe_w4a16/moe_w4a16_schedule.h"

namespace bg::ops::w4 {

using ptx::atomic_add_acq_rel;

// Everything a launch needs, by value (POD).
struct KernelArgs {
  int64_t proj_offset = 0;           // this projection's offset in an expert block
  ScheduleParams sched;              // items, k-stages, nb_cap, splits policy, dispatch active / offsets, blocks
  int64_t n_in = 0, n_out = 0;       // activation width; output width (gate/up: inter; down: hidden)
  float out_scale = 1.0f;            // 2^scale_shift
  const __nv_bfloat16* act = nullptr;  // gate/up: x [n_tokens, hidden]; down: h [rows, inter]
  int64_t act_ld = 0;                // elements from one row of act to the next (>= n_in, a multiple of 8)
  MoeWorkspace d;                    // the dispatch (offsets, active, n_active, row_token, row_weight, slot_row)
  int n_tokens = 0;                  // the step's tokens (the fused combine zeroes those without pairs)
  int top_k = 0;
  int n_items_down = 0;              // combine counters per token
  int n_items_gate_up = 0;           // overlap: gate/up passes per row chunk of an expert
  bool overlap = false;              // moe_w4a16_overlaps: per-expert ready counters instead of down's grid wait
  MoeW4a16Workspace ws;
  int table_cap = 0;                 // item table entries in dynamic shared memory (after the pipeline's buffers)
  int n_experts = 0;                 // stream-K: the pass-tile prefix after the table has n_experts + 1 entries
  void* out = nullptr;
  bool out_f32 = false, accumulate = false;
  bool rows_out = false;             // MoeW4a16Params::rows_out: x is the rows, out the unweighted bf16 rows
  bool combine_fused = true;         // down combines (else it only writes y: moe_w4a16_separate_combine)
  MoeW4a16Act act_kind = MoeW4a16Act::kSwiGLU;
  float beta = 4.0f, beta_lin = 25.0f;
};

// An item table entry as the kernel keeps it: a slot without weights flags kMoeErrorBadDescriptor and its rows are
// skipped (every item of it alike).
__device__ __forceinline__ ItemEntry checked_entry(const KernelArgs& a, ItemEntry en) {
  if (en.block == nullptr && en.rows > 0) {
    atomicOr(a.d.error_flags, kMoeErrorBadDescriptor);
    en.rows = 0;
  }
  return en;
}

// gate/up: h[row, col] = bf16(GLU(2^shift gate, 2^shift up)); tiles 2p / 2p+1 are gate / up of the same columns.
template <int NB>
__device__ void store_h(const Acc<NB>& acc, const Cursor& c, const KernelArgs& a) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int p = 0; p < kMTiles / 2; ++p)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = nb * 8 + (lane & 3) * 2 + (i & 1);
        const int64_t col = gate_up_column(c.m, warp, 2 * p, (lane >> 2) + (i >> 1) * 8);
        if (n >= c.chunk_rows || col >= a.n_out) continue;
        const float v = glu(acc[2 * p][nb][i] * a.out_scale, acc[2 * p + 1][nb][i] * a.out_scale, a.act_kind, a.beta,
                            a.beta_lin);
        a.ws.h[static_cast<int64_t>(c.chunk_row0 + n) * a.n_out + col] = __float2bfloat16(v);
      }
}

// Calls f(row, col, value) for each of this thread's accumulators of a down pass inside the chunk and the output
// (row: the chunk's permuted row, col: the output column, value: 2^shift acc).
template <int NB, class F>
__device__ __forceinline__ void for_each_down_result(const Acc<NB>& acc, const Cursor& c, const KernelArgs& a, F f) {
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = nb * 8 + (lane & 3) * 2 + (i & 1);
        const int64_t col = down_row(c.m, warp, mt, (lane >> 2) + (i >> 1) * 8);
        if (n >= c.chunk_rows || col >= a.n_out) continue;
        f(static_cast<int64_t>(c.chunk_row0 + n), col, acc[mt][nb][i] * a.out_scale);
      }
}

// down with rows out: out[row, col] = bf16(2^shift acc), no combine.
template <int NB>
__device__ void store_rows(const Acc<NB>& acc, const Cursor& c, const KernelArgs& a) {
  auto* out = static_cast<__nv_bfloat16*>(a.out);
  for_each_down_result<NB>(acc, c, a, [&](int64_t row, int64_t col, float v) {
    out[row * a.n_out + col] = __float2bfloat16(v);
  });
}

// The fused combine's shared state at the end of a down pass: the tokens whose last slot the pass completed, and
// each such token's (permuted row, routing weight) per slot, read from the dispatch in one parallel round.
struct CombineSmem {
  int n_done;
  int tokens[kChunkRows];
  int prow[kChunkRows * kMaxTopK];
  float weight[kChunkRows * kMaxTopK];
};

// out[token, 4 columns from col] = (accumulate ? out : 0) + sum_k w_k y_k, in fp32, one fma per slot in slot order
// (the CPU reference's order). The slots' y loads are issued kBatch at a time before their fmas, so a token costs a
// few memory latencies, not one per slot. kBatch: 8 on the wide shape, 4 on the narrow one (whose 128 registers
// spill more with 8). Measured on the H100 (bench/RESULTS.md 2026-12-06), 8 / 4 / 2: 0.505 / 0.511 / 0.525 ms at 64
// tokens on the wide shape, 0.385 / 0.376 / 0.383 ms at 16 tokens on the narrow one.
template <int kBatch>
__device__ __forceinline__ void combine_token(const KernelArgs& a, int token, const int* prow, const float* weight,
                                              int64_t col) {
  const int64_t o = static_cast<int64_t>(token) * a.n_out + col;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (a.accumulate) {
    if (a.out_f32) {
      acc = *reinterpret_cast<const float4*>(static_cast<const float*>(a.out) + o);
    } else {
      const uint2 bits = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(a.out) + o);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
      acc = make_float4(lo.x, lo.y, hi.x, hi.y);
    }
  }
#pragma unroll 1
  for (int k0 = 0; k0 < a.top_k; k0 += kBatch) {
    float4 y[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (k0 + j < a.top_k) {
        y[j] = __ldcg(reinterpret_cast<const float4*>(a.ws.y + static_cast<int64_t>(prow[k0 + j]) * a.n_out + col));
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (k0 + j < a.top_k) {
        const float w = weight[k0 + j];
        acc.x = fmaf(w, y[j].x, acc.x);
        acc.y = fmaf(w, y[j].y, acc.y);
        acc.z = fmaf(w, y[j].z, acc.z);
        acc.w = fmaf(w, y[j].w, acc.w);
      }
    }
  }
  if (a.out_f32) {
    *reinterpret_cast<float4*>(static_cast<float*>(a.out) + o) = acc;
  } else {
    const __nv_bfloat162 lo = __float22bfloat162_rn(make_float2(acc.x, acc.y));
    const __nv_bfloat162 hi = __float22bfloat162_rn(make_float2(acc.z, acc.w));
    uint2 bits;
    bits.x = *reinterpret_cast<const uint32_t*>(&lo);
    bits.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + o) = bits;
  }
}

// The combine of the tokens warp 0 listed in cs (n_done > 0) for the down item m's 512 columns: the slots' rows and
// weights into shared memory in one parallel round of loads, then each half of the CTA a token at a time.
template <int kBatch>
__device__ __forceinline__ void combine_done_tokens(const KernelArgs& a, CombineSmem& cs, int m) {
  const int tid = static_cast<int>(threadIdx.x);
  const int n_done = cs.n_done;
  for (int e = tid; e < n_done * a.top_k; e += kThreads) {
    const int r = e / a.top_k;
    const int prow = a.d.slot_row[static_cast<int64_t>(cs.tokens[r]) * a.top_k + (e - r * a.top_k)];
    cs.prow[e] = prow;
    cs.weight[e] = a.d.row_weight[prow];
  }
  __syncthreads();
  // Each half of the CTA combines every other token, 4 of the item's 512 columns per thread.
  const int half = tid / (kThreads / 2);
  const int64_t col = static_cast<int64_t>(m) * kCombineCols + 4 * (tid % (kThreads / 2));
  if (col < a.n_out) {  // n_out % 32 == 0: all 4 columns valid
    for (int r = half; r < n_done; r += 2) {
      combine_token<kBatch>(a, cs.tokens[r], cs.prow + r * a.top_k, cs.weight + r * a.top_k, col);
    }
  }
  __syncthreads();  // cs is rewritten by the next pass
}

// out[token, 4 columns from col] = 0.
__device__ __forceinline__ void zero_columns(const KernelArgs& a, int token, int64_t col) {
  const int64_t o = static_cast<int64_t>(token) * a.n_out + col;
  if (a.out_f32) {
    *reinterpret_cast<float4*>(static_cast<float*>(a.out) + o) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  } else {
    *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(a.out) + o) = make_uint2(0u, 0u);
  }
}

// The fused combine overwriting `out` (accumulate false): a token without a pair on this rank (a decode graph's
// padding row) is completed by no pass, so its row is zeroed here, CTA cta taking tokens cta, cta + grid, ... In an
// all-local routing a token has either every pair or none (padding), so its first slot tells.
__device__ __forceinline__ void zero_tokens_without_pairs(const KernelArgs& a, int cta, int grid) {
  for (int t = cta; t < a.n_tokens; t += grid) {
    if (a.d.slot_row[static_cast<int64_t>(t) * a.top_k] >= 0) continue;  // uniform over the CTA
    for (int64_t col = 4 * static_cast<int64_t>(threadIdx.x); col < a.n_out; col += 4 * kThreads) {
      zero_columns(a, t, col);  // n_out % 32 == 0: all 4 columns valid
    }
  }
}

// down with the combine in a kernel of its own: y[row, col] (fp32) only.
template <int NB>
__device__ void store_y(const Acc<NB>& acc, const Cursor& c, const KernelArgs& a) {
  for_each_down_result<NB>(acc, c, a, [&](int64_t row, int64_t col, float v) {
    __stcg(a.ws.y + row * a.n_out + col, v);
  });
}

// down: y[row, col] (fp32); then the fused combine of every token whose last slot this pass completed.
template <int NB, int kBatch>
__device__ void store_y_and_combine(const Acc<NB>& acc, const Cursor& c, const KernelArgs& a, CombineSmem& cs) {
  static_assert(kChunkRows <= 32 && kCombineCols == 4 * kThreads / 2, "warp 0 counts, each half-CTA 4 columns");
  const int tid = static_cast<int>(threadIdx.x);
  store_y<NB>(acc, c, a);
  // Release y, count the rows as done, acquire the other slots' y (pattern as in reduce_splits: the counting
  // threads' fences are cumulative over the CTA's y stores the barrier ordered before them). Warp 0 counts (a chunk
  // has at most 32 rows) and lists the tokens it completed; their counters go back to zero for the next launch.
  __syncthreads();
  if (tid < 32) {
    int token = -1;
    if (tid < c.chunk_rows) {
      const int t = a.d.row_token[c.chunk_row0 + tid];
      int32_t* counter = &a.ws.token_counters[static_cast<int64_t>(t) * a.n_items_down + c.m];
      if (atomic_add_acq_rel(counter, 1) == a.top_k - 1) {
        token = t;
        *counter = 0;  // its last user (stream-ordered before the next launch)
      }
    }
    const unsigned done = __ballot_sync(0xffffffffu, token >= 0);
    if (token >= 0) cs.tokens[__popc(done & ((1u << tid) - 1u))] = token;
    if (tid == 0) cs.n_done = __popc(done);
  }
  __syncthreads();
  if (cs.n_done > 0) combine_done_tokens<kBatch>(a, cs, c.m);  // uniform
}

}  // namespace bg::ops::w4

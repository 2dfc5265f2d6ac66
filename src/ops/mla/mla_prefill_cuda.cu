// MLA prefill launcher (mla_prefill_cuda.h): per pass, gather -> two batched cuBLAS GEMMs (k_nope, v) -> the
// attention kernel (mla_prefill_wgmma.cu by default, mla_prefill_mma_sync.cu as the option). One stream, no host
// synchronisation, no allocation. docs/MLA_PREFILL.md.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/mla/mla_prefill_internal.cuh"

namespace bg::ops {
namespace {

using mla_prefill::AttnArgs;
using mla_prefill::bf16;
using mla_prefill::kNope;
using mla_prefill::kQk;
using mla_prefill::kRope;
using mla_prefill::kV;

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

// k [rows, heads, 192]: columns 128..191 of every head = the row's k_pe (shared by the heads), 16 bytes a thread.
__global__ void mla_prefill_k_pe_heads_kernel(const bf16* __restrict__ k_pe, bf16* __restrict__ k, int64_t rows,
                                              int heads) {
  constexpr int kChunks = kRope / 8;
  const int64_t n = rows * heads * kChunks;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / (int64_t{heads} * kChunks);
    const int c = static_cast<int>(i % kChunks);
    const int64_t head_row = i / kChunks;  // row * heads + head
    reinterpret_cast<uint4*>(k + head_row * kQk + kNope)[c] = reinterpret_cast<const uint4*>(k_pe + row * kRope)[c];
  }
}

// Merges the output of one cuDNN call into each query's running softmax state. grid (ceil(max n_q / 8), pieces),
// block 256: one warp per (piece row), looping over heads, 4 channels a lane. A piece's row holds o_part (the softmax-
// normalised output over the piece's keys, bf16) and its log-sum-exp lse; the state is (m, l) and o = Σ exp(lse_i - m)
// o_i over the pieces so far, fp32. A first piece starts the state, a final one writes out = o / l.
struct MergeArgs {
  const MlaPrefillPiece* pieces;
  const float* stats;  // [B, heads, stats_rows]
  int64_t stats_rows;
  const bf16* o_part;  // [tokens, heads, 128]
  float* state_o;      // [tokens, heads, 128]
  float* state_ml;     // [tokens, heads, 2]
  bf16* out;           // [tokens, heads, 128]
  int heads;
};
__global__ void __launch_bounds__(256) mla_prefill_merge_kernel(MergeArgs a) {
  const MlaPrefillPiece piece = a.pieces[blockIdx.y];
  const int r = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (r >= piece.n_q) return;
  const int64_t token = int64_t{piece.q_row0} + r;
  const bool first = (piece.flags & kMlaPieceFirst) != 0, final = (piece.flags & kMlaPieceFinal) != 0;
  for (int h = 0; h < a.heads; ++h) {
    const int64_t th = token * a.heads + h;
    const float lse = a.stats[(int64_t{piece.index} * a.heads + h) * a.stats_rows + r];
    const uint2 raw = reinterpret_cast<const uint2*>(a.o_part + th * kV)[lane];
    const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
    const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
    const float4 part{__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi)};
    float4 o = part;
    float m = lse, l = 1.0f;
    if (!first) {
      const float m_old = a.state_ml[th * 2], l_old = a.state_ml[th * 2 + 1];
      const float4 o_old = reinterpret_cast<const float4*>(a.state_o + th * kV)[lane];
      m = fmaxf(m_old, lse);
      const float keep = __expf(m_old - m), add = __expf(lse - m);
      o = {o_old.x * keep + part.x * add, o_old.y * keep + part.y * add, o_old.z * keep + part.z * add,
           o_old.w * keep + part.w * add};
      l = l_old * keep + add;
    }
    if (final) {
      const float inv = 1.0f / l;
      const __nv_bfloat162 w0 = __floats2bfloat162_rn(o.x * inv, o.y * inv);
      const __nv_bfloat162 w1 = __floats2bfloat162_rn(o.z * inv, o.w * inv);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&w0);
      packed.y = *reinterpret_cast<const uint32_t*>(&w1);
      reinterpret_cast<uint2*>(a.out + th * kV)[lane] = packed;
    } else {
      reinterpret_cast<float4*>(a.state_o + th * kV)[lane] = o;
      if (lane == 0) {
        a.state_ml[th * 2] = m;
        a.state_ml[th * 2 + 1] = l;
      }
    }
  }
}

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
  BG_CHECK(ctx.cublas && ctx.workspace && cuda::aligned_to(ctx.workspace, 256) && ctx.workspace_bytes >= ws.total_bytes,
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
  const bool exact = nope == kNope && rope == kRope && cuda::aligned_to(q, 16);
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
  a.scale_log2 = p.softmax_scale * mla_prefill::kLog2e;

  // cublasSetStream resets the workspace to cuBLAS's own pool, so the caller's workspace is bound after it.
  BG_CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
  BG_CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, ctx.cublas_workspace_bytes));
  const float one = 1.0f, zero = 0.0f;
  // cuDNN takes the step at the production dims (q read in place, 16-byte aligned output rows) when it has a plan for
  // every call; otherwise the whole step runs on the kernel (the two keep their cross-pass state differently).
  auto* pieces = reinterpret_cast<const MlaPrefillPiece*>(base + ws.pieces);
  std::vector<MlaCudnnLaunch> calls;
  if (mma == MlaPrefillMma::kCudnn && ctx.cudnn != nullptr && exact && v_head == kV && cuda::aligned_to(out, 16) &&
      ws.n_heads == h && ws.n_tokens == p.n_tokens && mla_prefill_cudnn_fits(plan, p.n_tokens, h)) {
    auto* o_part = reinterpret_cast<bf16*>(base + ws.o_part);
    for (const MlaPrefillCudnnCall& call : plan.cudnn_calls) {
      const int64_t q0 = plan.pieces[static_cast<size_t>(call.piece_begin)].q_row0;
      const auto* arrays = reinterpret_cast<const int32_t*>(base + ws.cudnn + call.meta);
      const int64_t at = mla_prefill_cudnn_stride(call.batch);
      BG_CHECK(call.direct || ws.o_part != ws.state_ml || p.n_tokens == 0, "{}: workspace has no o_part region", op);
      MlaCudnnLaunch l{call.batch,        h,          call.max_q,      call.max_kv,
                       p.softmax_scale,   call.causal, q + q0 * h * kQk, k_nope,
                       v,                 (call.direct ? out : o_part) + q0 * h * kV,
                       arrays,            arrays + at, arrays + 2 * at,  arrays + 3 * at,
                       arrays + 4 * at,   arrays + 5 * at, call.uniform,  call.kv_row0};
      if (!ctx.cudnn->takes(l)) {
        calls.clear();
        break;
      }
      calls.push_back(l);
    }
  }
  const bool on_cudnn = !calls.empty();
  for (size_t pass_index = 0; pass_index < plan.passes.size(); ++pass_index) {
    const MlaPrefillPass& pass = plan.passes[pass_index];
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
    // On a cuDNN pass k_nope lands in columns 0..127 of the whole q/k head [rows, H, 192], k_pe beside it.
    const int k_stride = on_cudnn ? static_cast<int>(kQk) : static_cast<int>(kNope);
    BG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, nope, rows, lora, &one, w_uk,
                                               CUDA_R_16BF, lora, int64_t{nope} * lora, c_kv, CUDA_R_16BF, lora, 0,
                                               &zero, k_nope, CUDA_R_16BF, h * k_stride, k_stride, h,
                                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    BG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, v_head, rows, lora, &one, w_uv,
                                               CUDA_R_16BF, lora, int64_t{v_head} * lora, c_kv, CUDA_R_16BF, lora, 0,
                                               &zero, v, CUDA_R_16BF, h * kV, kV, h, CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    if (on_cudnn) {
      const int64_t chunks = int64_t{rows} * h * (kRope / 8);
      mla_prefill_k_pe_heads_kernel<<<static_cast<unsigned>(std::min<int64_t>(4096, (chunks + 255) / 256)), 256, 0,
                                      stream>>>(k_pe, k_nope, rows, h);
      BG_CUDA_CHECK_LAUNCH();
      for (size_t c = 0; c < calls.size(); ++c) {
        const MlaPrefillCudnnCall& call = plan.cudnn_calls[c];
        if (call.pass != static_cast<int64_t>(pass_index)) continue;
        BG_CHECK(ctx.cudnn->run(calls[c], stream), "{}: cuDNN declined a plan it had built", op);
        if (call.direct) continue;
        const MergeArgs m{pieces + call.piece_begin, ctx.cudnn->stats(), ctx.cudnn->stats_rows(),
                          reinterpret_cast<const bf16*>(base + ws.o_part), a.state_o, a.state_ml, out, h};
        mla_prefill_merge_kernel<<<dim3(static_cast<unsigned>((call.max_q + 7) / 8),
                                        static_cast<unsigned>(call.n_pieces)),
                                   256, 0, stream>>>(m);
        BG_CUDA_CHECK_LAUNCH();
      }
      continue;
    }
    a.items = items + pass.item_begin;
    const auto n_items = static_cast<unsigned>(pass.n_items), n_heads = static_cast<unsigned>(h);
    if (mma != MlaPrefillMma::kMmaSync) {
      mla_prefill::launch_attention_wgmma(a, n_items, n_heads, stream);
    } else {
      mla_prefill::launch_attention_mma_sync(a, n_items, n_heads, stream);
    }
  }
}

const char* mla_prefill_mma_name(MlaPrefillMma mma) {
  switch (mma) {
    case MlaPrefillMma::kWgmma: return "wgmma";
    case MlaPrefillMma::kMmaSync: return "mma.sync";
    case MlaPrefillMma::kCudnn: return "cudnn";
  }
  return "?";
}

MlaPrefillMma mla_prefill_mma_from_env() {
  switch (env_choice("BG_MLA_PREFILL", {"cudnn", "wgmma", "mmasync"})) {
    case 0: return MlaPrefillMma::kCudnn;
    case 1: return MlaPrefillMma::kWgmma;
    case 2: return MlaPrefillMma::kMmaSync;
    default: return MlaCudnnPrefill::built() ? MlaPrefillMma::kCudnn : MlaPrefillMma::kWgmma;
  }
}

MlaPrefillKernelInfo mla_prefill_kernel_info(MlaPrefillMma mma) {
  return mma != MlaPrefillMma::kMmaSync ? mla_prefill::attention_info_wgmma() : mla_prefill::attention_info_mma_sync();
}

}  // namespace bg::ops

// MLA prefill on the GPU in the non-absorbed form (FlashAttention class: wgmma, or mma.sync tensor cores). For each
// pass of the plan (mla_prefill_plan.h): gather the prefill sequences' latent context from the paged cache, expand it
// per head with two batched cuBLAS GEMMs (k_nope = W_UK c, v = W_UV c), then one attention launch over (query tile,
// head) with an online softmax, the causal mask by position, and the softmax state carried across passes in fp32.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/mla/mla_cuda.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_prefill_cudnn.h"
#include "ops/mla/mla_prefill_plan.h"

namespace bg::ops {

// Caller-owned resources, as for the decode launch: the cuBLAS handle (bound to the stream and workspace before each
// GEMM) and the prefill workspace of at least ws.total_bytes (mla_prefill_workspace), 256-byte aligned, whose first
// ws.meta_bytes already hold mla_prefill_meta(plan, ws) (uploaded once per step; the launch only reads them), and
// for MlaPrefillMma::kCudnn the cuDNN runner (one per stream; it keeps its plans across steps).
struct MlaPrefillContext : MlaDecodeContext {
  MlaCudnnPrefill* cudnn = nullptr;
};

// Which attention runs a pass (same work, same results to bf16 rounding).
enum class MlaPrefillMma : uint8_t {
  kWgmma,    // sm_90a warpgroup MMA: Q·Kᵀ from shared memory, P·V with P in registers; 96 keys per tile
  kMmaSync,  // mma.sync.m16n8k16 fed by ldmatrix; 64 keys per tile (the FlashAttention-2 formulation)
  // cuDNN's fused attention on every whole-contexts pass at the production head dims (mla_prefill_cudnn.h); the
  // wgmma kernel runs the other passes, and those cuDNN declines. The backend's default where cuDNN is built in.
  kCudnn,
};
const char* mla_prefill_mma_name(MlaPrefillMma mma);
// BG_MLA_PREFILL=cudnn|wgmma|mmasync, or unset: kCudnn where this build links cuDNN, else kWgmma. Any other value
// throws bg::Error naming the choices.
MlaPrefillMma mla_prefill_mma_from_env();

// The prefill sequences' tokens of the plan (same contract as mla_attention_cuda for those tokens):
//   q    [n_tokens, n_heads, qk_nope + qk_rope] bf16 (rows of other tokens are not read)
//   w_uk [n_heads, qk_nope, kv_lora] bf16,  w_uv [n_heads, v_head, kv_lora] bf16
//   out  [n_tokens, n_heads, v_head] bf16 (rows of other tokens are not written)
// cache.seq_idx / cache.positions are not read: the plan carries the layout, cache.block_tables (row = step sequence)
// and the written latents are. Requires mla_prefill_takes(p); p.n_tokens is the step's token count. A block-table
// entry that is negative where the context is read raises kMlaErrorBadBlock and reads as zeros.
void mla_prefill_cuda(const MlaParams& p, const MlaPrefillPlan& plan, const MlaPrefillWorkspace& ws,
                      const __nv_bfloat16* q, const __nv_bfloat16* w_uk, const __nv_bfloat16* w_uv,
                      const MlaPagedCache& cache, __nv_bfloat16* out, const MlaPrefillContext& ctx,
                      cudaStream_t stream, MlaPrefillMma mma = MlaPrefillMma::kWgmma);

// Registers per thread, local (spill) bytes and shared memory of the attention kernel, for the benchmark.
struct MlaPrefillKernelInfo {
  int registers = 0;
  size_t local_bytes = 0;
  size_t smem_bytes = 0;
};
MlaPrefillKernelInfo mla_prefill_kernel_info(MlaPrefillMma mma = MlaPrefillMma::kWgmma);

}  // namespace bg::ops

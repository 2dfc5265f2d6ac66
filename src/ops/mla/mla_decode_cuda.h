// MLA absorbed decode on the GPU (FlashMLA class): W_UK absorption and W_UV projection as batched cuBLAS GEMMs,
// split-KV tensor-core attention over the paged latent cache, and a log-sum-exp combine. The plan (mla_decode_plan.h)
// is made on the host; this launcher only launches (no allocation, no host sync, no host reads of device data), so a
// decode step can be captured into a CUDA graph and replayed with new positions and block tables.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "ops/mla/mla_cuda.h"
#include "ops/mla/mla_decode_plan.h"

namespace bg::ops {

// Device tensors of one decode launch (same meaning as mla_attention_cuda):
//   q    [n_tokens, n_heads, qk_nope + 64] bf16 (q_nope | q_pe)
//   w_uk [n_heads, qk_nope, 512] bf16,  w_uv [n_heads, v_head, 512] bf16
//   out  [n_tokens, n_heads, v_head] bf16
struct MlaDecodeTensors {
  const __nv_bfloat16* q = nullptr;
  const __nv_bfloat16* w_uk = nullptr;
  const __nv_bfloat16* w_uv = nullptr;
  __nv_bfloat16* out = nullptr;
};

// Caller-owned resources: the cuBLAS handle (bound to the stream and workspace before each GEMM) and the decode
// workspace of at least plan.ws.total_bytes, 256-byte aligned. The workspace is scratch for one launch at a time.
struct MlaDecodeContext {
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  size_t cublas_workspace_bytes = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// One decode step of an MLA layer: token t (one per sequence) attends to positions 0..cache.positions[t] of sequence
// cache.seq_idx[t], which must be written already. Requirements (bg::Error otherwise): the plan was made for these
// params (mla_decode_plan), cache entries of 576 bf16 with a 16-byte aligned base and block stride, q 2-byte aligned.
// Any block size works. Caller bugs in the step layout are reported through cache.error_flags (the backend fails
// the step at its next synchronisation): a position past its block table raises kMlaErrorBadPosition and the launch
// computes nothing; a negative block-table entry that would be read raises kMlaErrorBadBlock. Without error_flags
// either traps. Five launches: absorb GEMM, schedule + q_pe copy, attention, combine, W_UV GEMM.
void mla_decode_cuda(const MlaDecodePlan& plan, const MlaDecodeTensors& t, const MlaPagedCache& cache,
                     const MlaDecodeContext& ctx, cudaStream_t stream);

// Shared memory one attention CTA uses for a plan (bytes; the kernel opts in above 48 KiB) and the kernel's
// registers per thread and local (spill) bytes, for the benchmark's resource report.
size_t mla_decode_attention_smem_bytes(const MlaDecodePlan& plan);
struct MlaDecodeKernelInfo {
  int registers = 0;
  size_t local_bytes = 0;
  size_t smem_bytes = 0;
};
MlaDecodeKernelInfo mla_decode_attention_kernel_info(const MlaDecodePlan& plan);

}  // namespace bg::ops

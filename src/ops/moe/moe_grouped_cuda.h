// The dequantize-once prefill path of the expert FFN on the device: per group of touched experts, their gate/up/down
// weights (MXFP4, FP8 or bf16) are dequantized once into a bf16 scratch, then gate|up and down run as cuBLAS grouped
// GEMMs (cublasGemmGroupedBatchedEx, bf16 tensor cores, fp32 accumulation) over each expert's rows of the dispatch's
// permuted order, with the GLU between. Same inputs and outputs as moe_expert_ffn_cuda (x_perm -> h -> y_perm), so
// dispatch, gather and combine are unchanged. Host plan: moe_grouped.h. Included only by CUDA code, the backend, tests.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "ops/moe/moe_cuda.h"
#include "ops/moe/moe_grouped.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"

namespace bg::ops {

// Caller-owned device memory of one call (sizes from moe_grouped.h). The weight scratch is the backend's reusable
// per-device workspace (cuda::MoeGroupedScratch); gu and the pointer arrays are per call.
struct MoeGroupedBuffers {
  __nv_bfloat16* weights = nullptr;  // >= plan.group_experts * moe_grouped_expert_bytes, bf16
  size_t weight_bytes = 0;
  __nv_bfloat16* gu = nullptr;  // >= moe_grouped_gu_bytes(plan): [rows of a group, 2 inter] gate | up outputs
  size_t gu_bytes = 0;
  void** pointers = nullptr;  // >= moe_grouped_pointer_bytes(plan), written by moe_grouped_write_pointers
  size_t pointer_bytes = 0;
};

// Which cuBLAS entry point runs the expert GEMMs of a group. kPerExpert (the default): one cublasGemmEx per expert
// and projection. kGrouped: one cublasGemmGroupedBatchedEx call per projection and group (same operands and types;
// BG_MOE_GROUPED_GEMM=grouped). On the H200 (cuBLAS 13.0) per expert ran 0.40 / 0.67 / 0.84 of the bf16 grouped
// GEMM ceiling at 292 / 1170 / 4681 rows per expert, the grouped call 0.27 / 0.33 / 0.40 (bench/RESULTS.md).
enum class MoeGroupedGemmApi : uint8_t { kGrouped, kPerExpert };

// The API from the value of BG_MOE_GROUPED_GEMM: null / empty / "per_expert" -> kPerExpert, "grouped" -> kGrouped;
// anything else throws naming the variable.
MoeGroupedGemmApi moe_grouped_gemm_api(const char* env_value);

// cuBLAS handle and workspace (the backend's); the launcher binds them to the stream before each call.
struct MoeGroupedContext {
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  size_t cublas_workspace_bytes = 0;
  MoeGroupedGemmApi api = MoeGroupedGemmApi::kGrouped;
};

struct MoeGroupedArgs {
  const MoeGroupedPlan* plan = nullptr;
  const ExpertWeightsCuda* experts = nullptr;  // device array [n_slots], as for moe_expert_ffn_cuda
  const MoeW4a16Weights* packed = nullptr;     // or MXFP4 experts in the W4A16 layout (dequantized from it)
  MoeWorkspace ws;                             // x_perm, h, y_perm and error_flags are used
  MoeGroupedBuffers bufs;
  MoeGroupedContext ctx;
};

// Downloads the dispatch's per-slot counts and builds the plan: synchronises `stream` (the grouped GEMM takes its
// row counts on the host). Not capturable; an error under graph capture.
MoeGroupedPlan moe_grouped_plan_from_device(const MoeCudaParams& p, const MoeWorkspace& ws, int64_t group_experts,
                                            cudaStream_t stream);

// Writes the pointer arrays of every grouped GEMM call of the plan into a.bufs.pointers (one copy from host memory,
// stream-ordered; not capturable). Must run again whenever the plan, the workspace or the buffers change.
void moe_grouped_write_pointers(const MoeGroupedArgs& a, cudaStream_t stream);

// Dequantizes the experts of group `group` into a.bufs.weights: expert j of the group at j * expert bytes, gate rows
// [0, inter), up rows [inter, 2 inter) of a [2 inter, hidden] matrix, then down [hidden, inter]; value =
// bf16(code * scale), as the tiled kernel rounds it (from a.packed: the same bits). A descriptor that disagrees with
// p, or a null block pointer, raises kMoeErrorBadDescriptor and its matrix is not read.
void moe_grouped_dequant_cuda(const MoeCudaParams& p, const MoeGroupedArgs& a, size_t group, cudaStream_t stream);

// The FFN over the plan: per group, dequant -> gu = x_perm W_gu^T (bf16 out) -> h = bf16(GLU(g, u)) in fp32 ->
// y_perm = h W_down^T (bf16 out). No host synchronisation and no allocation (capturable once the pointers are
// written); p must be the params the dispatch ran with (p.act is the GLU).
void moe_expert_ffn_grouped_cuda(const MoeCudaParams& p, const MoeGroupedArgs& a, cudaStream_t stream);

}  // namespace bg::ops

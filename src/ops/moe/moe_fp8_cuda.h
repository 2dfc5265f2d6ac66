// The FP8 prefill path of the expert FFN on the device (host side and numerics: moe_fp8.h). Same plan, inputs and
// outputs as the dequantize-once path (moe_grouped_cuda.h: x_perm -> y_perm over the touched experts), different
// arithmetic: per call the x rows are quantized to E4M3 with one scale per 128 inputs; per group of experts their
// weights are converted to E4M3 (MXFP4 experts in the W4A16 layout, exactly; a checkpoint's FP8 experts are used as
// stored), then per expert gate|up = one cuBLASLt block-scaled FP8 GEMM (bf16 out), h = GLU(gate, up) in fp32
// quantized to E4M3 in the same kernel, and down = a second FP8 GEMM writing the expert's y rows. Opt-in
// (BG_MOE_PREFILL=fp8); included only by CUDA code, the backend and tests.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>

#include "ops/moe/moe_fp8.h"
#include "ops/moe/moe_grouped_cuda.h"

namespace bg::ops {

// How an operand's fp32 scales cover it: one per 128 consecutive inputs of each row, stored [blocks][rows] (the rows
// of a block contiguous); or one per 128 x 128 block, stored [ceil(rows / 128)][blocks] (a checkpoint's FP8 scales).
enum class Fp8ScaleMode : uint8_t { kVec128, kBlock128 };

// cuBLASLt's block-scaled E4M3 GEMM on Hopper (cuBLAS >= 12.9): D[n, m] (row-major bf16, row stride ldd) = B[n, k]
// A[m, k]^T, A and B row-major E4M3 (row strides k), each with its scales; fp32 accumulation with cuBLASLt's
// promotion per 128 inputs. cuBLASLt's heuristic is asked once per (m, k, A mode, ldd) and power-of-two bucket of n,
// its first 8 candidates timed on the problem at hand (BG_MOE_FP8_AUTOTUNE=0: its first alone), and the algorithm
// kept (an n it refuses gets its own). One per backend (device); not thread-safe (the backend's stream thread uses
// it).
class MoeFp8Gemm {
 public:
  struct Problem {
    int m = 0, n = 0, k = 0;
    const void* a = nullptr;
    const float* a_scale = nullptr;
    Fp8ScaleMode a_mode = Fp8ScaleMode::kVec128;
    const void* b = nullptr;
    const float* b_scale = nullptr;  // always kVec128
    void* d = nullptr;
    int ldd = 0;
  };

  MoeFp8Gemm();
  ~MoeFp8Gemm();
  MoeFp8Gemm(const MoeFp8Gemm&) = delete;
  MoeFp8Gemm& operator=(const MoeFp8Gemm&) = delete;

  // Enqueues one GEMM on `stream` with the caller's workspace. Throws (naming the shape and modes) when cuBLASLt has
  // no kernel for it; n == 0 does nothing.
  void run(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);
  size_t cached_algorithms() const { return algos_.size(); }
  int64_t heuristic_calls() const { return heuristic_calls_; }

 private:
  struct Key {
    int m, n, k, ldd;
    Fp8ScaleMode mode;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  // Runs the problem being enqueued with one algorithm (on its stream).
  using Matmul = std::function<cublasStatus_t(const cublasLtMatmulAlgo_t&)>;
  // The heuristic's algorithm for the shape with n rows; with autotuning (BG_MOE_FP8_AUTOTUNE, default 1) its first
  // kCandidates, each timed on the problem at hand (kTimedRuns runs after a warm-up, the stream synchronised), the
  // fastest kept.
  static constexpr int kCandidates = 8;
  static constexpr int kTimedRuns = 3;
  cublasLtMatmulAlgo_t find_algorithm(const Problem& p, int n, cublasLtMatmulDesc_t desc, size_t workspace_bytes,
                                      const Matmul& matmul, cudaStream_t stream);

  bool autotune_ = true;
  cublasLtHandle_t lt_ = nullptr;
  std::unordered_map<Key, cublasLtMatmulAlgo_t, KeyHash> algos_;
  int64_t heuristic_calls_ = 0;
};

// Whether the FP8 path can run a layer: MXFP4 experts in the W4A16 layout (`packed`), or FP8-block experts with a
// device copy; hidden and inter multiples of 16 (E4M3 operands' rows must stay 16-byte aligned).
bool moe_fp8_supported(const MoeCudaParams& p, bool packed, bool fp8_stages);

struct MoeFp8Args {
  const MoeGroupedPlan* plan = nullptr;
  const MoeW4a16Weights* packed = nullptr;           // MXFP4 experts in the W4A16 layout: converted per group
  const ExpertWeightsCuda* experts_host = nullptr;   // or FP8-block experts: host copies of the slots' descriptors
  MoeWorkspace ws;                                   // x_perm in, y_perm out, error_flags
  void* expert_scratch = nullptr;                    // >= group_experts x moe_fp8_expert_layout(..).bytes
  size_t expert_scratch_bytes = 0;
  void* call_buffer = nullptr;                       // >= moe_fp8_call_layout(plan).bytes, 256-byte aligned
  size_t call_buffer_bytes = 0;
  MoeFp8Gemm* gemm = nullptr;
  void* cublas_workspace = nullptr;
  size_t cublas_workspace_bytes = 0;
};

// Writes the experts' table (first rows, scale_row0: moe_fp8.h) into the call buffer: one copy from host memory,
// stream-ordered, not capturable. Must run before moe_expert_ffn_fp8_cuda whenever the plan or the buffer changes.
void moe_fp8_write_table(const MoeGroupedPlan& plan, void* call_buffer, size_t call_buffer_bytes,
                         cudaStream_t stream);

// The FFN over the plan (x_perm -> y_perm). No host synchronisation and no allocation (capturable once the table is
// written); p must be the params the dispatch ran with (p.act is the GLU).
void moe_expert_ffn_fp8_cuda(const MoeCudaParams& p, const MoeFp8Args& a, cudaStream_t stream);

// Converts the group's experts of the W4A16 layout into the FP8 scratch (moe_fp8_expert_layout per expert, expert j of
// the group at j x bytes). Exposed for the exactness test.
void moe_fp8_convert_w4a16_cuda(const MoeGroupedPlan& plan, const MoeGroupedGroup& g, const MoeW4a16Weights& w,
                                void* scratch, int32_t* error_flags, cudaStream_t stream);

}  // namespace bg::ops

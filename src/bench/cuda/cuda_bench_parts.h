// The pieces of the CUDA DeviceBench (cuda_bench.cpp wires them together): the event profiler, the ceilings, and the
// kernel-case runner.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_report.h"
#include "bench/op_profiler.h"

namespace bg::bench::cuda {

std::unique_ptr<StepProfiler> make_event_profiler(bool per_op);

// Device resources every measurement shares: one stream, one cuBLAS handle with its workspace.
struct CudaEnv {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  size_t cublas_workspace_bytes = 0;
  int64_t n_sms = 0;
  int64_t l2_bytes = 0;
};

// Every ceiling of Ceilings for the CUDA device (cuda_ceilings.cpp); quick: smaller buffers and fewer repeats.
Ceilings measure_cuda_ceilings(const CudaEnv& env, bool quick);

// A bf16 grouped GEMM over the 56 K3 experts of one EP16 rank (gate|up [6144 x 3584], down [3584 x 3072]) at several
// rows per expert (grouped_gemm.cpp).
std::vector<GroupedGemmPoint> measure_grouped_gemm(const CudaEnv& env, bool quick);

// Best time in ms of `reps` timed runs of fn after one warm-up run, bracketed by events on `stream`.
double best_ms(cudaStream_t stream, int reps, const std::function<void()>& fn);

// The registered kernel cases whose name contains `filter`, each as a fraction of `c` (kernel_harness.cpp).
std::vector<KernelResult> run_kernel_cases(const CudaEnv& env, const Ceilings& c, bool quick,
                                           const std::string& filter);

}  // namespace bg::bench::cuda

// The CUDA backend: bf16 activations, fp32 state and accumulation, weights as stored; one stream per backend.
#pragma once

#include <cstdint>
#include <memory>

#include "backend/backend.h"

namespace bg {

struct CudaBackendOptions {
  int device = -1;                // CUDA device ordinal; -1: the thread's current device (0, or a rank's GPU)
  size_t memory_budget_bytes = 0;  // 0: the free memory at start
  bool deterministic = false;      // BackendOptions::deterministic: batch-invariant kernel choices
  bool background_plans = false;   // BackendOptions::background_plans
};

// Throws bg::Error when no CUDA device is usable.
std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& options = {});

// What code outside the backend needs to run its own kernels in a backend's stream order (the ll expert exchange):
// the backend's cudaStream_t and its int32 kernel error word (ops/moe/moe_cuda.h bits; the step's download reports
// them). Throws bg::Error when `be` is not the CUDA backend.
struct CudaStreamContext {
  void* stream = nullptr;
  int32_t* error_flags = nullptr;
};
CudaStreamContext cuda_stream_context(Backend& be);

}  // namespace bg

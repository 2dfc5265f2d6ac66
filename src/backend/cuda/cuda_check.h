// Error checks for every CUDA runtime / cuBLAS call and after every kernel launch: failures throw bg::Error naming
// the call, file and line (never a silent error code).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/error.h"

namespace bg::cuda {

// Whether p is a multiple of `bytes`: the host's test before a vectorised (16-byte), TMA or wgmma launch.
inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* what, const char* file, int line);

}  // namespace bg::cuda

#define BG_CUDA_CHECK(call)                                                           \
  do {                                                                                \
    cudaError_t bg_err_ = (call);                                                     \
    if (bg_err_ != cudaSuccess) ::bg::cuda::throw_cuda_error(bg_err_, #call, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: catches bad configurations at once (asynchronous faults surface at the next sync).
#define BG_CUDA_CHECK_LAUNCH() BG_CUDA_CHECK(cudaGetLastError())

#define BG_CUBLAS_CHECK(call)                                                           \
  do {                                                                                  \
    cublasStatus_t bg_st_ = (call);                                                     \
    if (bg_st_ != CUBLAS_STATUS_SUCCESS) ::bg::cuda::throw_cublas_error(bg_st_, #call, __FILE__, __LINE__); \
  } while (0)

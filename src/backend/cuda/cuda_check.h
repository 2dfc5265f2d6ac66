// Error checks for every CUDA runtime / cuBLAS call and after every kernel launch: failures throw bg::Error naming
// the call, file and line (never a silent error code). An error that left the CUDA context unusable (sticky: an
// illegal address, a launch failure, an ECC error, ...) throws bg::DeviceFault instead, so that the worker restarts
// rather than run requests on a dead context.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/device_fault.h"
#include "core/error.h"

namespace bg::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* what, const char* file, int line);

// The codes the CUDA documentation calls sticky ("any further CUDA work will return the same error; the process must
// be terminated and relaunched").
bool is_sticky_cuda_error_code(cudaError_t err);
// Whether `err`, just returned by a call, left the context unusable: a sticky code, or any error that the context
// still reports after the recoverable one is cleared (cudaGetLastError) — a probe that is legal during stream capture.
// Recoverable errors (out of memory, an invalid argument) are cleared by it.
bool cuda_context_lost(cudaError_t err);

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

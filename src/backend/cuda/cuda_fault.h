// Sticky vs recoverable CUDA errors. throw_cuda_error (cuda_check.h, behind every BG_CUDA_CHECK) throws bg::DeviceFault
// (core/device_fault.h) when a failed call left the CUDA context unusable — an illegal address, a launch failure, an
// ECC error, ... — so that the worker restarts rather than run requests on a dead context; bg::Error otherwise.
#pragma once

#include <cuda_runtime.h>

namespace bg::cuda {

// The codes the CUDA documentation calls sticky ("any further CUDA work will return the same error; the process must
// be terminated and relaunched").
bool is_sticky_cuda_error_code(cudaError_t err);
// Whether `err`, just returned by a call, left the context unusable: a sticky code, or any error the context still
// reports after the recoverable one is cleared (cudaGetLastError, then cudaPeekAtLastError and a cudaMemGetInfo probe,
// all legal during stream capture). Recoverable errors (out of memory, an invalid argument) are cleared by it.
bool cuda_context_lost(cudaError_t err);

}  // namespace bg::cuda

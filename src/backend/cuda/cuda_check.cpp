// CUDA error reporting.
#include "backend/cuda/cuda_check.h"

#include <fmt/format.h>

namespace bg::cuda {

void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(err), cudaGetErrorString(err), what,
                          file, line));
}

void throw_cublas_error(cublasStatus_t status, const char* what, const char* file, int line) {
  throw Error(fmt::format("cuBLAS error {} ({}) in {} at {}:{}", cublasGetStatusName(status),
                          cublasGetStatusString(status), what, file, line));
}

}  // namespace bg::cuda

// CUDA error reporting and the sticky / recoverable classification (cuda_fault.h): a lost context throws
// bg::DeviceFault, anything else bg::Error.
#include "backend/cuda/cuda_check.h"

#include <fmt/format.h>

#include "backend/cuda/cuda_fault.h"
#include "core/device_fault.h"

namespace bg::cuda {

bool is_sticky_cuda_error_code(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

bool cuda_context_lost(cudaError_t err) {
  if (err == cudaSuccess) return false;
  if (is_sticky_cuda_error_code(err)) return true;
  (void)cudaGetLastError();  // clears a recoverable error; a sticky one stays
  if (cudaPeekAtLastError() != cudaSuccess) return true;
  size_t free_bytes = 0, total = 0;  // a call that needs the context (and is legal while a stream is captured)
  const cudaError_t probe = cudaMemGetInfo(&free_bytes, &total);
  if (probe == cudaSuccess) return false;
  (void)cudaGetLastError();
  return is_sticky_cuda_error_code(probe) || cudaPeekAtLastError() != cudaSuccess;
}

void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  std::string message = fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(err),
                                    cudaGetErrorString(err), what, file, line);
  if (cuda_context_lost(err)) {
    throw DeviceFault(message + "; the CUDA context is unusable (a sticky error): the process must restart");
  }
  throw Error(message);
}

void throw_cublas_error(cublasStatus_t status, const char* what, const char* file, int line) {
  std::string message = fmt::format("cuBLAS error {} ({}) in {} at {}:{}", cublasGetStatusName(status),
                                    cublasGetStatusString(status), what, file, line);
  // cuBLAS reports a kernel that faulted as an execution failure; the context says whether it is lost.
  const cudaError_t last = cudaPeekAtLastError();
  if (last != cudaSuccess && cuda_context_lost(last)) {
    throw DeviceFault(message + fmt::format(" after CUDA error {}; the CUDA context is unusable (a sticky error): the "
                                            "process must restart", cudaGetErrorName(last)));
  }
  throw Error(message);
}

}  // namespace bg::cuda

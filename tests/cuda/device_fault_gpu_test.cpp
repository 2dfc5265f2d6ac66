// Sticky CUDA errors on the GPU: a real illegal-address fault (a kernel writing near address 0, run in a child process
// so that this one keeps a usable context) is classified as sticky — BG_CUDA_CHECK throws bg::DeviceFault, the
// context still reports the error afterwards and the CUDA backend's next synchronisation throws DeviceFault too — while
// recoverable errors (out of memory, an invalid argument) throw a plain bg::Error and leave the context usable.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_fault.h"
#include "core/device_fault.h"
#include "cuda/cuda_testing.h"
#include "ops/elementwise/elementwise_cuda.h"

namespace bg::testing {
namespace {

constexpr int kSawDeviceFault = 42;

// The child's body: prints what it saw and exits kSawDeviceFault only when every check holds.
[[noreturn]] void fault_in_child() {
  std::unique_ptr<Backend> backend = make_cuda_backend();
  // y += x over 1M bf16 values at an address in the never-mapped first page: an illegal address on the device.
  auto* bogus = reinterpret_cast<__nv_bfloat16*>(uintptr_t{256});
  try {
    ops::add_inplace_cuda(int64_t{1} << 20, bogus, bogus, nullptr);  // its launch check may already see the fault
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    std::fprintf(stderr, "no error after the faulting kernel\n");
    std::_Exit(1);
  } catch (const DeviceFault& e) {
    std::fprintf(stderr, "DeviceFault: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "a recoverable error, not a DeviceFault: %s\n", e.what());
    std::_Exit(2);
  }
  void* p = nullptr;
  const cudaError_t after = cudaMalloc(&p, 1024);  // sticky: later work fails with the same error
  std::fprintf(stderr, "cudaMalloc after the fault: %s\n", cudaGetErrorName(after));
  if (after == cudaSuccess) std::_Exit(3);
  try {
    backend->synchronize();
    std::fprintf(stderr, "the backend synchronised on a dead context\n");
    std::_Exit(4);
  } catch (const DeviceFault& e) {
    std::fprintf(stderr, "backend: DeviceFault: %s\n", e.what());
  }
  std::fflush(stderr);
  std::_Exit(kSawDeviceFault);
}

TEST(CudaDeviceFault, IllegalAddressIsStickyAndThrowsDeviceFault) {
  BG_REQUIRE_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child re-executes this binary: a fresh CUDA context
  EXPECT_EXIT(fault_in_child(), ::testing::ExitedWithCode(kSawDeviceFault),
              "DeviceFault: CUDA error cudaError(IllegalAddress|LaunchFailure).*sticky");
}

// "none", "error" (a recoverable bg::Error) or "fault" (bg::DeviceFault) for what `check` throws.
template <typename F>
std::string thrown_by(F check) {
  try {
    check();
  } catch (const DeviceFault&) {
    return "fault";
  } catch (const Error&) {
    return "error";
  }
  return "none";
}

TEST(CudaDeviceFault, RecoverableErrorsAreNotSticky) {
  BG_REQUIRE_GPU();
  void* p = nullptr;
  const size_t huge = std::numeric_limits<size_t>::max() / 2;
  const cudaError_t oom = cudaMalloc(&p, huge);
  ASSERT_EQ(oom, cudaErrorMemoryAllocation);
  EXPECT_FALSE(cuda::cuda_context_lost(oom));
  EXPECT_EQ(thrown_by([&] { BG_CUDA_CHECK(cudaMalloc(&p, huge)); }), "error");
  char host[16] = {};
  EXPECT_EQ(thrown_by([&] { BG_CUDA_CHECK(cudaMemcpy(nullptr, host, sizeof(host), cudaMemcpyHostToDevice)); }),
            "error");  // an invalid argument
  EXPECT_EQ(thrown_by([] { BG_CUDA_CHECK(cudaSetDevice(1 << 20)); }), "error");  // no such device
  EXPECT_FALSE(cuda::is_sticky_cuda_error_code(cudaErrorInvalidValue));
  EXPECT_TRUE(cuda::is_sticky_cuda_error_code(cudaErrorMisalignedAddress));
  // The context is still usable.
  ASSERT_EQ(cudaMalloc(&p, 1024), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace bg::testing

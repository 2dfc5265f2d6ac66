// The CUDA DeviceBench: device 0's properties and NVML clocks, one stream and cuBLAS handle shared by the ceilings and
// the kernel cases, and the event profiler for model steps.
#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_moe.h"
#include "backend/cuda/device_buffer.h"
#include "bench/cuda/cuda_bench_parts.h"
#include "bench/cuda/nvml.h"
#include "bench/device_bench.h"
#include "core/log.h"
#include "ops/linear/linear_cuda.h"

namespace bg::bench {
namespace {

class CudaBench final : public DeviceBench {
 public:
  CudaBench() {
    BG_CHECK(bg::cuda::device_count() > 0, "bench --device cuda: no CUDA device is visible (driver missing or no GPU)");
    BG_CUDA_CHECK(cudaSetDevice(env_.device));
    cudaDeviceProp prop{};
    BG_CUDA_CHECK(cudaGetDeviceProperties(&prop, env_.device));
    name_ = prop.name;
    env_.n_sms = prop.multiProcessorCount;
    env_.l2_bytes = prop.l2CacheSize;
    memory_bytes_ = static_cast<int64_t>(prop.totalGlobalMem);
    BG_CUDA_CHECK(cudaStreamCreate(&env_.stream));
    BG_CUBLAS_CHECK(cublasCreate(&env_.cublas));
    workspace_ = bg::cuda::DeviceBuffer(ops::kCublasWorkspaceBytes);
    env_.cublas_workspace = workspace_.data();
    env_.cublas_workspace_bytes = workspace_.bytes();
    BG_CUBLAS_CHECK(cublasSetStream(env_.cublas, env_.stream));
    BG_CUBLAS_CHECK(cublasSetWorkspace(env_.cublas, env_.cublas_workspace, env_.cublas_workspace_bytes));
  }
  ~CudaBench() override {
    cudaStreamSynchronize(env_.stream);
    cublasDestroy(env_.cublas);
    cudaStreamDestroy(env_.stream);
  }

  DeviceInfo info() override {
    DeviceInfo d;
    d.device = "cuda";
    d.name = name_;
    d.n_sms = env_.n_sms;
    d.l2_bytes = env_.l2_bytes;
    d.memory_bytes = memory_bytes_;
    const cuda::NvmlInfo nvml = cuda::query_nvml(env_.device);
    d.driver = nvml.driver;
    d.sm_clock_mhz = nvml.sm_clock_mhz;
    d.mem_clock_mhz = nvml.mem_clock_mhz;
    d.sm_clock_max_mhz = nvml.sm_clock_max_mhz;
    d.mem_clock_max_mhz = nvml.mem_clock_max_mhz;
    return d;
  }
  Ceilings ceilings(bool quick) override { return cuda::measure_cuda_ceilings(env_, quick); }
  std::vector<KernelResult> kernels(const Ceilings& c, bool quick, const std::string& filter) override {
    std::vector<KernelResult> out = cuda::run_kernel_cases(env_, c, quick, filter);
    BG_CUDA_CHECK(cudaDeviceSynchronize());  // an asynchronous fault of the last case surfaces here, named
    return out;
  }
  std::unique_ptr<StepProfiler> profiler(bool per_op) override { return cuda::make_event_profiler(per_op); }
  int64_t act_bytes() const override { return 2; }
  std::map<std::string, uint64_t> path_counts() const override {
    return {{"moe_grouped", bg::cuda::moe_grouped_calls()},
            {"moe_w4a16_prefill", bg::cuda::moe_w4a16_prefill_calls()},
            {"moe_fp8_prefill", bg::cuda::moe_fp8_prefill_calls()}};
  }

 private:
  cuda::CudaEnv env_;
  std::string name_;
  int64_t memory_bytes_ = 0;
  bg::cuda::DeviceBuffer workspace_;
};

}  // namespace

std::unique_ptr<DeviceBench> make_cuda_bench() { return std::make_unique<CudaBench>(); }

}  // namespace bg::bench

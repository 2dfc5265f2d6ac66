// The device-specific half of `batchgen bench`: what the device is, its ceilings measured now, the kernel cases, and
// the per-op profiler for model steps. CPU: cpu_bench.cpp (host wall clock; CI keeps the harness working with it);
// CUDA: cuda/cuda_bench.cpp (events, graphs, cuBLAS, NVML).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_report.h"
#include "bench/op_profiler.h"

namespace bg::bench {

class DeviceBench {
 public:
  virtual ~DeviceBench() = default;
  virtual DeviceInfo info() = 0;
  // quick: smaller buffers and fewer repeats (seconds on a CI machine).
  virtual Ceilings ceilings(bool quick) = 0;
  // Every registered kernel case whose name contains `filter` (empty: all), as fractions of `c`.
  virtual std::vector<KernelResult> kernels(const Ceilings& c, bool quick, const std::string& filter) = 0;
  virtual std::unique_ptr<StepProfiler> profiler(bool per_op) = 0;
  // Bytes per activation / MLA cache value of the device's backend (CUDA bf16: 2; CPU fp32: 4).
  virtual int64_t act_bytes() const = 0;
  // Process-wide counts of backend calls by the path they took, where more than one can run the same op (CUDA: the
  // MoE prefill paths, "moe_grouped" and "moe_w4a16_prefill"); a run's figures are attributed by their differences.
  virtual std::map<std::string, uint64_t> path_counts() const { return {}; }
};

// "cpu" or "cuda" (a bg::Error naming what is missing when this build or machine has no CUDA).
std::unique_ptr<DeviceBench> make_device_bench(const std::string& device);

std::unique_ptr<DeviceBench> make_cpu_bench();
#ifdef BG_HAVE_CUDA
std::unique_ptr<DeviceBench> make_cuda_bench();
#endif

// Median of the values (0 when empty).
double median(std::vector<double> values);

}  // namespace bg::bench

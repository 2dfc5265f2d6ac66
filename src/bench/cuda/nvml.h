// Driver version and clocks from NVML, loaded at run time (nvml.cpp); every field is empty when NVML is missing.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace bg::bench::cuda {

struct NvmlInfo {
  std::optional<std::string> driver;
  std::optional<int64_t> sm_clock_mhz, mem_clock_mhz, sm_clock_max_mhz, mem_clock_max_mhz;
};

// Never throws; logs a warning when NVML or the device is unavailable.
NvmlInfo query_nvml(int cuda_device);

}  // namespace bg::bench::cuda

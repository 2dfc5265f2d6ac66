// NVML through dlopen at run time (libnvidia-ml.so.1 ships with the driver, not the toolkit): the binary needs no NVML
// to link or to start, and a machine without it gets null fields and a log line.
#include "bench/cuda/nvml.h"

#include <dlfcn.h>

#include <cuda_runtime.h>

#include "core/log.h"

namespace bg::bench::cuda {
namespace {

// The few NVML entry points used, declared here by their documented C signatures (nvml.h is not needed).
using NvmlReturn = int;  // NVML_SUCCESS = 0
using NvmlDevice = void*;
constexpr int kClockSm = 1, kClockMem = 2;  // nvmlClockType_t
using InitFn = NvmlReturn (*)();
using ShutdownFn = NvmlReturn (*)();
using HandleByPciFn = NvmlReturn (*)(const char*, NvmlDevice*);
using DriverVersionFn = NvmlReturn (*)(char*, unsigned int);
using ClockFn = NvmlReturn (*)(NvmlDevice, int, unsigned int*);

template <typename Fn>
Fn symbol(void* lib, const char* name) {
  return reinterpret_cast<Fn>(dlsym(lib, name));
}

}  // namespace

NvmlInfo query_nvml(int cuda_device) {
  NvmlInfo info;
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    log::warn("bench: NVML not available ({}); driver version and clocks are reported as null", dlerror());
    return info;
  }
  auto init = symbol<InitFn>(lib, "nvmlInit_v2");
  auto shutdown = symbol<ShutdownFn>(lib, "nvmlShutdown");
  auto by_pci = symbol<HandleByPciFn>(lib, "nvmlDeviceGetHandleByPciBusId_v2");
  auto driver = symbol<DriverVersionFn>(lib, "nvmlSystemGetDriverVersion");
  auto clock = symbol<ClockFn>(lib, "nvmlDeviceGetClockInfo");
  auto max_clock = symbol<ClockFn>(lib, "nvmlDeviceGetMaxClockInfo");
  if (init == nullptr || shutdown == nullptr || by_pci == nullptr || driver == nullptr || clock == nullptr ||
      max_clock == nullptr || init() != 0) {
    log::warn("bench: NVML could not be initialised; driver version and clocks are reported as null");
    dlclose(lib);
    return info;
  }
  char version[96] = {};
  if (driver(version, sizeof version) == 0) info.driver = version;
  char pci[32] = {};
  NvmlDevice dev = nullptr;
  if (cudaDeviceGetPCIBusId(pci, sizeof pci, cuda_device) == cudaSuccess && by_pci(pci, &dev) == 0) {
    unsigned int mhz = 0;
    if (clock(dev, kClockSm, &mhz) == 0) info.sm_clock_mhz = mhz;
    if (clock(dev, kClockMem, &mhz) == 0) info.mem_clock_mhz = mhz;
    if (max_clock(dev, kClockSm, &mhz) == 0) info.sm_clock_max_mhz = mhz;
    if (max_clock(dev, kClockMem, &mhz) == 0) info.mem_clock_max_mhz = mhz;
  } else {
    cudaGetLastError();  // a failed PCI query must not stay as the sticky last error
    log::warn("bench: NVML has no handle for CUDA device {}; clocks are reported as null", cuda_device);
  }
  shutdown();
  dlclose(lib);
  return info;
}

}  // namespace bg::bench::cuda

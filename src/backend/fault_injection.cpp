// inject_device_fault_if_armed: one unlink per step while armed, nothing otherwise.
#include "backend/fault_injection.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "core/device_fault.h"
#include "core/log.h"

namespace bg {
namespace {

// Read once: the path, or "" when not armed (the warning says so in the log of every process that has it).
const std::string& armed_path() {
  static const std::string path = [] {
    const char* v = std::getenv(kDeviceFaultFileEnv);
    std::string p = v == nullptr ? "" : v;
    if (!p.empty()) {
      log::warn("{} is set: a sticky device fault will be injected at the first step after {} appears (a test hook)",
                kDeviceFaultFileEnv, p);
    }
    return p;
  }();
  return path;
}

}  // namespace

void inject_device_fault_if_armed(std::string_view backend) {
  const std::string& path = armed_path();
  if (path.empty() || ::unlink(path.c_str()) != 0) return;  // unlink: only one process and one step take the fault
  throw DeviceFault(fmt::format("CUDA error cudaErrorIllegalAddress (an illegal memory access was encountered) "
                                "injected into a {} step by {}; the device context is unusable (a sticky error): the "
                                "process must restart", backend, kDeviceFaultFileEnv));
}

}  // namespace bg

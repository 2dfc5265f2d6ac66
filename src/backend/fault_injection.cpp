// inject_device_fault_if_armed: one unlink per step while armed, nothing otherwise.
#include "backend/fault_injection.h"

#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/device_fault.h"
#include "core/log.h"

namespace bg {
namespace {

// The armed path, or "" (read at every step, so a test can arm it in its own process; a getenv is negligible next to
// a step). The first time it is seen armed, the log says so.
std::string armed_path() {
  const char* v = std::getenv(kDeviceFaultFileEnv);
  if (v == nullptr || *v == '\0') return "";
  static std::once_flag warned;
  std::call_once(warned, [v] {
    log::warn("{} is set: a sticky device fault will be injected at the first step after {} appears (a test hook)",
              kDeviceFaultFileEnv, v);
  });
  return v;
}

}  // namespace

void inject_device_fault_if_armed(std::string_view backend) {
  const std::string path = armed_path();
  if (path.empty() || ::unlink(path.c_str()) != 0) return;  // unlink: only one process and one step take the fault
  throw DeviceFault(fmt::format("CUDA error cudaErrorIllegalAddress (an illegal memory access was encountered) "
                                "injected into a {} step by {}; the device context is unusable (a sticky error): the "
                                "process must restart", backend, kDeviceFaultFileEnv));
}

}  // namespace bg

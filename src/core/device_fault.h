// DeviceFault: the error of a device whose context is unusable (a sticky CUDA error), which no retry in this process
// can recover from. The worker fails its requests and exits with kExitDeviceFault so that the frontend restarts it.
#pragma once

#include <string>

#include "core/error.h"

namespace bg {

class DeviceFault : public Error {
 public:
  explicit DeviceFault(const std::string& what) : Error(what) {}
};

// The exit status of a worker that stopped after a DeviceFault (distinct from 0 = stopped, 1 = failed to load, 127 =
// could not be started; the frontend names it in its log and restarts the worker set).
inline constexpr int kExitDeviceFault = 3;

}  // namespace bg

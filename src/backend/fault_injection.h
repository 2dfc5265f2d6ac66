// Test-only device-fault injection for the restart path of a worker whose device context is lost. Armed only by the
// environment of the process (BG_TEST_DEVICE_FAULT_FILE), never by a request, so no client can reach it.
#pragma once

#include <string_view>

namespace bg {

// The environment variable that arms it: a file path. While armed, the first step that begins while the file exists
// removes it (one-shot, also across a worker's restarts) and throws bg::DeviceFault as a sticky CUDA error would
// (cudaErrorIllegalAddress). Each backend calls this at the start of every step (Backend::begin_step).
inline constexpr const char* kDeviceFaultFileEnv = "BG_TEST_DEVICE_FAULT_FILE";
void inject_device_fault_if_armed(std::string_view backend);

}  // namespace bg

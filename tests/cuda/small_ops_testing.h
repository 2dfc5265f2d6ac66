// Helpers for the small-op parity tests: bf16 device buffers from host data rounded in place (so the CPU reference
// sees the GPU's inputs), poisoned output buffers, bf16 downloads, and a device-wide sync that surfaces kernel faults.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/device_buffer.h"
#include "cuda/cuda_testing.h"

namespace bg::testing {

// Rounds v to bf16 in place and uploads the bf16 values.
inline cuda::DeviceBuffer upload_bf16(std::vector<float>& v) { return cuda::upload(to_bf16(v)); }

// A device buffer of `bytes` filled with 0xff (NaN for bf16 / fp32).
inline cuda::DeviceBuffer poisoned(size_t bytes) {
  cuda::DeviceBuffer b(bytes);
  b.fill_bytes(0xff);
  return b;
}

inline std::vector<float> download_bf16(const cuda::DeviceBuffer& b, size_t n) {
  return from_bf16(cuda::download<uint16_t>(b, n));
}

inline __nv_bfloat16* bf16_ptr(const cuda::DeviceBuffer& b) { return b.as<__nv_bfloat16>(); }

// Waits for the device so that an asynchronous kernel fault fails the test here.
inline void sync_device() { BG_CUDA_CHECK(cudaDeviceSynchronize()); }

// The CPU reference's fp32 output rounded to bf16, as the GPU stores it.
inline std::vector<float> round_bf16(std::vector<float> v) {
  to_bf16(v);
  return v;
}

// Index of the first element where got and ref differ (NaN differs from everything), or -1 when they are identical.
inline int64_t first_mismatch(const std::vector<float>& got, const std::vector<float>& ref) {
  if (got.size() != ref.size()) return 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(got[i] == ref[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace bg::testing

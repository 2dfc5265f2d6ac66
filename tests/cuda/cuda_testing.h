// Shared helpers for the CUDA op-parity tests: skip (loudly) without a GPU, bf16 rounding so the CPU reference sees
// exactly the GPU's inputs, random data, and error measures that fail on NaN.
#pragma once

#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backend/cuda/device_buffer.h"
#include "core/dtype.h"

namespace bg::testing {

// Call first in every GPU test: without a device the test is reported as skipped with this message.
#define BG_REQUIRE_GPU()                                                              \
  do {                                                                                \
    if (::bg::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU test did not run"; \
  } while (0)

inline std::vector<float> random_floats(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Rounds every value to bf16 (in place) and returns the bf16 bit patterns for upload.
inline std::vector<uint16_t> to_bf16(std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    bits[i] = f32_to_bf16(v[i]);
    v[i] = bf16_to_f32(bits[i]);
  }
  return bits;
}

inline std::vector<float> from_bf16(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_f32(bits[i]);
  return v;
}

// max |got - ref| / max(|ref|) over everything; +inf if got has a NaN/Inf where ref is finite.
inline double max_rel_error(const std::vector<float>& got, const std::vector<float>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double max_diff = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(ref[i])) return INFINITY;
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

// Per-dtype tolerances for op parity (relative to the max |ref|).
inline constexpr double kTolF32 = 1e-5;
inline constexpr double kTolBf16Out = 1e-2;

}  // namespace bg::testing

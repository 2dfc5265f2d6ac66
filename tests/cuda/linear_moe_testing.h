// Helpers for the linear / router / MoE parity tests: fast deterministic random data for large weights (a hash of
// seed and index, filled in parallel), random weights in each stored format with their host QuantWeight, and device
// resources (cuBLAS handle + workspace) for the launchers.
#pragma once

#include <cublas_v2.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_buffer.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "cuda/cuda_testing.h"
#include "formats/quant.h"
#include "ops/linear/linear_cuda.h"

namespace bg::testing {

inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-scale, scale) from (seed, i).
inline float hash_uniform(uint64_t seed, uint64_t i, float scale) {
  const uint64_t h = mix64(seed * 0x100000001b3ull ^ mix64(i));
  return scale * (static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f);
}

// n bf16 values uniform in [-scale, scale) (bits), and the same values as fp32 in `values` when non-null.
inline std::vector<uint16_t> random_bf16(size_t n, float scale, uint64_t seed, std::vector<float>* values = nullptr) {
  std::vector<uint16_t> bits(n);
  if (values) values->resize(n);
  parallel_for(static_cast<int64_t>(n), 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      bits[static_cast<size_t>(i)] = f32_to_bf16(hash_uniform(seed, static_cast<uint64_t>(i), scale));
      if (values) (*values)[static_cast<size_t>(i)] = bf16_to_f32(bits[static_cast<size_t>(i)]);
    }
  });
  return bits;
}

// A random weight in a stored format: the host QuantWeight (views into the tensors below) for the CPU reference.
struct HostWeight {
  HostTensor data;
  HostTensor scale;
  QuantWeight w;
};

// Dense: bf16 values uniform in [-scale, scale). FP8: codes with sign, exponent field 2..10 and any mantissa (no NaN),
// block scales in [scale/32, 3 scale/32), so |w| < ~1.4 scale. MXFP4: every byte value equally likely (all 16 codes,
// -0 included), E8M0 exponents around log2(scale/4). `dense_f32` stores dense weights as F32 (tests the upload's bf16
// rounding).
inline HostWeight random_weight(WeightFormat format, int64_t n_out, int64_t n_in, float scale, uint64_t seed,
                                bool dense_f32 = false) {
  HostWeight hw;
  const size_t n = static_cast<size_t>(n_out * n_in);
  switch (format) {
    case WeightFormat::kDense: {
      hw.data = HostTensor(dense_f32 ? DType::kF32 : DType::kBF16, {n_out, n_in});
      std::byte* dst = hw.data.data();
      parallel_for(static_cast<int64_t>(n), 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const float v = hash_uniform(seed, static_cast<uint64_t>(i), scale);
          if (dense_f32) {
            std::memcpy(dst + 4 * i, &v, 4);
          } else {
            const uint16_t bits = f32_to_bf16(v);
            std::memcpy(dst + 2 * i, &bits, 2);
          }
        }
      });
      break;
    }
    case WeightFormat::kFp8Block: {
      hw.data = HostTensor(DType::kF8E4M3, {n_out, n_in});
      auto* codes = reinterpret_cast<uint8_t*>(hw.data.data());
      parallel_for(static_cast<int64_t>(n), 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const uint64_t h = mix64(seed ^ mix64(static_cast<uint64_t>(i)));
          const uint32_t exp_field = 2 + static_cast<uint32_t>((h >> 8) % 9);
          codes[i] = static_cast<uint8_t>((h & 0x80) | (exp_field << 3) | ((h >> 16) & 7));
        }
      });
      const int64_t rb = (n_out + 127) / 128, cb = (n_in + 127) / 128;
      hw.scale = HostTensor(DType::kF32, {rb, cb});
      auto* s = reinterpret_cast<float*>(hw.scale.data());
      for (int64_t i = 0; i < rb * cb; ++i)
        s[i] = scale * (1.0f + 0.5f * hash_uniform(seed + 1, static_cast<uint64_t>(i), 1.0f)) / 16;
      break;
    }
    case WeightFormat::kMxfp4: {
      hw.data = HostTensor(DType::kU8, {n_out, n_in / 2});
      auto* codes = reinterpret_cast<uint8_t*>(hw.data.data());
      parallel_for(static_cast<int64_t>(n / 2), 1 << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) codes[i] = static_cast<uint8_t>(mix64(seed ^ mix64(static_cast<uint64_t>(i))));
      });
      hw.scale = HostTensor(DType::kU8, {n_out, n_in / 32});
      auto* s = reinterpret_cast<uint8_t*>(hw.scale.data());
      const int base = 127 + static_cast<int>(std::floor(std::log2(scale / 4)));
      for (size_t i = 0; i < n / 32; ++i) s[i] = static_cast<uint8_t>(base - 1 + static_cast<int>(mix64(seed + i) % 3));
      break;
    }
  }
  hw.w.format = format;
  hw.w.n_out = n_out;
  hw.w.n_in = n_in;
  hw.w.data = hw.data.view("w");
  if (format != WeightFormat::kDense) hw.w.scale = hw.scale.view("w.scale");
  hw.w.name = "test";
  return hw;
}

// EXPECT max_rel_error(got, ref) <= tol, and print the measured error (the margin is worth seeing when kernels
// change).
inline void expect_parity(const std::vector<float>& got, const std::vector<float>& ref, double tol,
                          const std::string& what) {
  const double err = max_rel_error(got, ref);
  std::printf("  [parity] %-60s rel err %.3g (tol %.0e)\n", what.c_str(), err, tol);
  EXPECT_LE(err, tol) << what;
}

// A cuBLAS handle and workspace owned by the test (the backend owns them in the engine).
struct CublasFixture {
  cublasHandle_t handle = nullptr;
  cuda::DeviceBuffer workspace{ops::kCublasWorkspaceBytes};
  CublasFixture() { BG_CUBLAS_CHECK(cublasCreate(&handle)); }
  ~CublasFixture() { cublasDestroy(handle); }
  CublasFixture(const CublasFixture&) = delete;
  CublasFixture& operator=(const CublasFixture&) = delete;
};

}  // namespace bg::testing

// The wgmma shared-memory matrix descriptor of a 128-byte-swizzle operand (PTX ISA 9.7.15.5.1.2), shared by the
// tensor-core kernels (MLA decode and prefill, the W4A16 experts) and, host-side, by the layout tests that decode
// what a kernel encodes. No CUDA types.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define BG_WGMMA_HD __host__ __device__ __forceinline__
#else
#define BG_WGMMA_HD inline
#endif

namespace bg::ops::wgmma {

// K-major SW128 ignores the leading byte offset (1 by convention) and puts 8-row groups 1024 B apart.
inline constexpr uint32_t kKMajorLbo = 16, kKMajorSbo = 1024;

// Start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45, base offset 0
// (atoms 1024-byte aligned), 128-byte swizzle (1 << 62).
BG_WGMMA_HD uint64_t sw128_desc(uint32_t start_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((start_addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(sbo_bytes >> 4) << 32) | (uint64_t{1} << 62);
}
BG_WGMMA_HD uint64_t sw128_k_major_desc(uint32_t start_addr) { return sw128_desc(start_addr, kKMajorLbo, kKMajorSbo); }

}  // namespace bg::ops::wgmma

// The benchmark's own device kernels: the read and copy ceilings, an empty kernel (graph node overhead), and seeded
// fills that give kernel cases realistic inputs (finite bf16 / fp32, NaN-free FP8 codes, sane E8M0 scales, expert
// ids). Every launcher checks its launch; none synchronises.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace bg::bench::cuda {

// Reads n 16-byte words with a grid-stride loop over `grid` x 512 threads; the XOR of everything read is stored to
// *sink only when it equals an impossible value, so nothing can be optimised away and nothing is written.
void launch_read(const uint4* data, size_t n, uint4* sink, int grid, cudaStream_t stream);
// dst[i] = src[i] for n 16-byte words, grid-stride over `grid` x 512 threads.
void launch_copy(const uint4* src, uint4* dst, size_t n, int grid, cudaStream_t stream);
// <<<1, 32>>> doing nothing.
void launch_empty(cudaStream_t stream);

// Seeded fills (value i depends only on seed and i).
void fill_uniform_bf16(__nv_bfloat16* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t stream);
void fill_uniform_f32(float* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t stream);
// Random bytes (MXFP4 E2M1 code pairs: every byte is valid).
void fill_random_bytes(uint8_t* p, size_t n, uint64_t seed, cudaStream_t stream);
// Random FP8 E4M3 codes of magnitude below 2 (exponent field <= 7), so never NaN.
void fill_fp8_e4m3(uint8_t* p, size_t n, uint64_t seed, cudaStream_t stream);
// Bytes uniform in [lo, hi] (E8M0 scales: 127 = 2^0).
void fill_u8_range(uint8_t* p, size_t n, int lo, int hi, uint64_t seed, cudaStream_t stream);

}  // namespace bg::bench::cuda

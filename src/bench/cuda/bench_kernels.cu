// The benchmark's device kernels (see bench_kernels.h): ceiling kernels and seeded fills.
#include "bench/cuda/bench_kernels.h"

#include "backend/cuda/cuda_check.h"

namespace bg::bench::cuda {
namespace {

constexpr int kThreads = 512;

// One 16-byte load per thread per iteration: the widest plain load, so the read ceiling is what the memory system
// delivers, not what the instruction issue rate allows.
__global__ void read_kernel(const uint4* __restrict__ data, size_t n, uint4* sink) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 v = data[i];
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
  }
  if (acc.x == 0x9e3779b9u && acc.y == 0x7f4a7c15u && acc.z == 0xf39cc060u && acc.w == 0x5ced8a2bu) *sink = acc;
}

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

__global__ void empty_kernel() {}

__device__ uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform in [0, 1) for element i.
__device__ float unit(uint64_t seed, size_t i) {
  return static_cast<float>(mix64(seed ^ mix64(i)) >> 40) * (1.0f / 16777216.0f);
}

__global__ void fill_bf16_kernel(__nv_bfloat16* p, size_t n, float lo, float hi, uint64_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    p[i] = __float2bfloat16(lo + (hi - lo) * unit(seed, i));
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, float lo, float hi, uint64_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    p[i] = lo + (hi - lo) * unit(seed, i);
  }
}

// mode 0: any byte; mode 1: FP8 E4M3 with exponent field <= 7 (|x| < 2, never the NaN code); mode 2: [lo, hi].
__global__ void fill_u8_kernel(uint8_t* p, size_t n, int mode, int lo, int hi, uint64_t seed) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t r = mix64(seed ^ mix64(i));
    uint8_t v = static_cast<uint8_t>(r);
    if (mode == 1) v = static_cast<uint8_t>(v & 0xbf);  // clear the exponent's top bit: S 0EEE MMM
    if (mode == 2) v = static_cast<uint8_t>(lo + static_cast<int>(r % static_cast<uint64_t>(hi - lo + 1)));
    p[i] = v;
  }
}

// Enough CTAs to fill the GPU for a fill; fills are setup, not measured.
int fill_grid(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 8192 ? (blocks == 0 ? 1 : blocks) : 8192);
}

}  // namespace

void launch_read(const uint4* data, size_t n, uint4* sink, int grid, cudaStream_t stream) {
  read_kernel<<<grid, kThreads, 0, stream>>>(data, n, sink);
  BG_CUDA_CHECK_LAUNCH();
}

void launch_copy(const uint4* src, uint4* dst, size_t n, int grid, cudaStream_t stream) {
  copy_kernel<<<grid, kThreads, 0, stream>>>(src, dst, n);
  BG_CUDA_CHECK_LAUNCH();
}

void launch_empty(cudaStream_t stream) {
  empty_kernel<<<1, 32, 0, stream>>>();
  BG_CUDA_CHECK_LAUNCH();
}

void fill_uniform_bf16(__nv_bfloat16* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t stream) {
  fill_bf16_kernel<<<fill_grid(n), kThreads, 0, stream>>>(p, n, lo, hi, seed);
  BG_CUDA_CHECK_LAUNCH();
}

void fill_uniform_f32(float* p, size_t n, float lo, float hi, uint64_t seed, cudaStream_t stream) {
  fill_f32_kernel<<<fill_grid(n), kThreads, 0, stream>>>(p, n, lo, hi, seed);
  BG_CUDA_CHECK_LAUNCH();
}

void fill_random_bytes(uint8_t* p, size_t n, uint64_t seed, cudaStream_t stream) {
  fill_u8_kernel<<<fill_grid(n), kThreads, 0, stream>>>(p, n, 0, 0, 255, seed);
  BG_CUDA_CHECK_LAUNCH();
}

void fill_fp8_e4m3(uint8_t* p, size_t n, uint64_t seed, cudaStream_t stream) {
  fill_u8_kernel<<<fill_grid(n), kThreads, 0, stream>>>(p, n, 1, 0, 255, seed);
  BG_CUDA_CHECK_LAUNCH();
}

void fill_u8_range(uint8_t* p, size_t n, int lo, int hi, uint64_t seed, cudaStream_t stream) {
  BG_CHECK(lo >= 0 && hi <= 255 && lo <= hi, "fill_u8_range: bad range [{}, {}]", lo, hi);
  fill_u8_kernel<<<fill_grid(n), kThreads, 0, stream>>>(p, n, 2, lo, hi, seed);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::bench::cuda

// Read-pattern probe (bench/h200-w4a16-experiments-facf899.txt, section 6): does streaming contiguous 17408-byte
// blocks per CTA (the W4A16 layout's stage blocks, in runs of `run` consecutive blocks per CTA item) reach the
// grid-stride read rate? Standalone: nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o probe w4a16_stream_probe.cu
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__global__ void grid_stride(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x9e3779b9u) *sink = acc;
}
// CTA b takes runs b, b + grid, ...; a run is `run` consecutive blocks of 17408 B; threads read the block with uint4
// loads, `unroll` blocks in flight per iteration.
template <int kUnroll>
__global__ void blocked(const uint8_t* p, int64_t n_runs, int run, uint32_t* sink) {
  constexpr int kBlock = 17408;
  uint32_t acc = 0;
  for (int64_t r = blockIdx.x; r < n_runs; r += gridDim.x) {
    const uint8_t* base = p + r * run * (int64_t)kBlock;
    for (int b = 0; b < run; b += kUnroll) {
      uint4 v[kUnroll][5];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < 5; ++i) {
          const int off = (threadIdx.x + i * blockDim.x) * 16;
          v[u][i] = (b + u < run && off < kBlock) ? __ldcs(reinterpret_cast<const uint4*>(base + (int64_t)(b + u) * kBlock + off)) : make_uint4(0,0,0,0);
        }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < 5; ++i) acc ^= v[u][i].x ^ v[u][i].w;
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}
int main() {
  const int64_t bytes = 56LL * 17547264;  // 56 K3 experts, packed
  uint8_t* d; uint32_t* sink; cudaMalloc(&d, bytes); cudaMalloc(&sink, 4); cudaMemset(d, 1, bytes);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto time = [&](auto launch, double nbytes, const char* name) {
    launch(); cudaDeviceSynchronize();
    float best = 1e9;
    for (int r = 0; r < 7; ++r) { cudaEventRecord(a); launch(); cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); if (ms < best) best = ms; }
    printf("%-58s %8.1f GB/s  (%.3f ms)\n", name, nbytes / (best * 1e6), best);
  };
  const int64_t n16 = bytes / 16;
  for (int per : {4, 16}) { char nm[96]; snprintf(nm, 96, "grid-stride uint4, %d CTAs x 512 per SM", per);
    time([&] { grid_stride<<<sms * per, 512>>>((const uint4*)d, n16, sink); }, n16 * 16.0, nm); }
  for (int run : {1, 28, 56}) for (int thr : {256, 512, 1024}) for (int ctas : {1, 2}) {
    if (thr * ctas > 2048) continue;
    const int64_t n_runs = bytes / 17408 / run; const double nb = n_runs * run * 17408.0;
    char nm[96]; snprintf(nm, 96, "blocked run %2d, %4d threads, %d CTA/SM, 2 blocks in flight", run, thr, ctas);
    time([&] { blocked<2><<<sms * ctas, thr>>>(d, n_runs, run, sink); }, nb, nm);
    snprintf(nm, 96, "blocked run %2d, %4d threads, %d CTA/SM, 4 blocks in flight", run, thr, ctas);
    time([&] { blocked<4><<<sms * ctas, thr>>>(d, n_runs, run, sink); }, nb, nm);
  }
  return 0;
}

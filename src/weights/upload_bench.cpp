// bench_store_upload: register, copy segment by segment on one stream (CUDA events for timing), pinned reference.
#include "weights/upload_bench.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "weights/store_source.h"

#ifdef BG_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace bg::weights {

#ifdef BG_HAVE_CUDA
namespace {

void check(cudaError_t e, const char* what) { BG_CHECK(e == cudaSuccess, "{}: {}", what, cudaGetErrorString(e)); }

// Best of `repeats` rates (GB/s) of copying `chunks` (host pointer, bytes) into `dst` back to back.
double copy_rate(const std::vector<std::pair<const void*, size_t>>& chunks, void* dst, int repeats, cudaStream_t s) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    size_t bytes = 0, off = 0;
    check(cudaEventRecord(a, s), "record");
    for (const auto& [p, n] : chunks) {
      check(cudaMemcpyAsync(static_cast<char*>(dst) + off, p, n, cudaMemcpyHostToDevice, s), "copy");
      bytes += n;
      off += n;
    }
    check(cudaEventRecord(b, s), "record");
    check(cudaEventSynchronize(b), "sync");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, a, b), "elapsed");
    best = std::max(best, static_cast<double>(bytes) / (ms / 1e3) / 1e9);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

}  // namespace

nlohmann::json bench_store_upload(const std::string& store, int device, int repeats) {
  BG_CHECK(repeats >= 1, "--repeats {} must be >= 1", repeats);
  check(cudaSetDevice(device), "cudaSetDevice");
  auto src = StoreSource::open_shm(store, 0);
  std::vector<std::pair<const void*, size_t>> segs;
  size_t total = 0;
  for (const HostRegion& r : src->pinnable_regions()) {
    segs.emplace_back(r.data, r.bytes);
    total += r.bytes;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& [p, n] : segs) {
    check(cudaHostRegister(const_cast<void*>(p), n, cudaHostRegisterPortable | cudaHostRegisterReadOnly),
          "cudaHostRegister");
  }
  const double register_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaStream_t s;
  check(cudaStreamCreate(&s), "stream");
  void* dev = nullptr;
  check(cudaMalloc(&dev, total), "cudaMalloc (the whole store)");
  const double store_gbps = copy_rate(segs, dev, repeats, s);
  // The ceiling: the same bytes from a cudaMallocHost buffer (1 GiB, reused).
  const size_t ref_bytes = std::min<size_t>(total, size_t{1} << 30);
  void* pinned = nullptr;
  check(cudaMallocHost(&pinned, ref_bytes), "cudaMallocHost");
  std::vector<std::pair<const void*, size_t>> ref;
  for (size_t done = 0; done < total; done += ref_bytes) ref.emplace_back(pinned, std::min(ref_bytes, total - done));
  const double pinned_gbps = copy_rate(ref, dev, repeats, s);
  cudaFreeHost(pinned);
  cudaFree(dev);
  cudaStreamDestroy(s);
  for (const auto& [p, n] : segs) cudaHostUnregister(const_cast<void*>(p));
  return {{"store", store},
          {"bytes", total},
          {"segments", segs.size()},
          {"register_seconds", register_s},
          {"store_to_gpu_gb_per_s", store_gbps},
          {"pinned_h2d_gb_per_s", pinned_gbps},
          {"fraction_of_pinned", pinned_gbps > 0 ? store_gbps / pinned_gbps : 0.0}};
}

#else

nlohmann::json bench_store_upload(const std::string& store, int device, int repeats) {
  (void)device;
  (void)repeats;
  fail("weightd bench {}: this build has no CUDA backend (configure with CUDA to measure store -> GPU rates)", store);
}

#endif

}  // namespace bg::weights

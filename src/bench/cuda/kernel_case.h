// The kernel-case registry of `batchgen bench kernels`. A case is one small struct: a name (<op>_<phase>[_variant]),
// the bytes of one input set, and prepare(), which allocates its inputs and returns the launch and the bytes / FLOPs
// model of one call. The harness (kernel_harness.cpp) captures many launches into one CUDA graph, rotating through
// input sets so the working set exceeds the L2, takes the median replay, reads every kernel node's registers, shared
// memory and occupancy, and reports the time as a fraction of the run's ceilings. A new kernel is one `r.add({...})`
// in the kernel_cases_*.cpp of its area.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/cuda/device_buffer.h"
#include "bench/cuda/cuda_bench_parts.h"

namespace bg::bench::cuda {

// Device memory of one case, filled with seeded values of realistic magnitude; freed when the case is done.
class CaseMemory {
 public:
  explicit CaseMemory(cudaStream_t stream) : stream_(stream) {}
  void* zeros(size_t bytes);
  template <typename T>
  T* zeros_of(size_t n) {
    return static_cast<T*>(zeros(n * sizeof(T)));
  }
  __nv_bfloat16* bf16(size_t n, float scale = 1.0f);  // uniform in [-scale, scale]
  float* f32(size_t n, float lo, float hi);
  uint8_t* bytes(size_t n);                           // uniform bytes (MXFP4 E2M1 code pairs)
  uint8_t* fp8(size_t n);                             // E4M3 codes, |x| < 2
  uint8_t* e8m0(size_t n);                            // MXFP4 block scales 2^-9 .. 2^-5 (weights of std ~0.02)
  template <typename T>
  T* upload(const std::vector<T>& host) {
    auto* p = static_cast<T*>(zeros(host.size() * sizeof(T)));
    BG_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  size_t total_bytes() const { return total_; }

 private:
  cudaStream_t stream_;
  std::vector<bg::cuda::DeviceBuffer> buffers_;
  uint64_t seed_ = 1;
  size_t total_ = 0;
};

struct KernelCost {
  double bytes = 0;  // bytes one call must move at least (weights, KV, state, inputs and outputs)
  double flops = 0;  // FLOPs of the algorithm the op stands for (not of a particular implementation)
};

struct PreparedKernel {
  KernelCost cost;
  // Issues exactly one call's work on input set `set` (0 .. n_sets - 1) on `stream`: no synchronisation and no
  // allocation (the harness captures it into a graph many times). Must check its launches.
  std::function<void(int set, cudaStream_t stream)> launch;
};

// Which compute ceiling a compute-bound case is a fraction of.
enum class ComputeRef : uint8_t {
  kGemm,         // cuBLAS bf16 8192^3
  kGroupedGemm,  // the grouped bf16 expert GEMM at the nearest rows per expert
};

struct KernelCase {
  std::string name;   // <op>_<phase>[_variant], e.g. moe_decode_w4a16, mla_decode, kda_chunked_prefill
  std::string shape;  // e.g. "B=16 ctx=4096"
  // Device bytes one input set occupies: the harness makes ceil(2 x L2 / set_bytes) sets (at most 64, at most 16 GiB)
  // so that consecutive launches in the graph read cold memory.
  double set_bytes = 0;
  ComputeRef compute_ref = ComputeRef::kGemm;
  int64_t rows_per_expert = 0;  // kGroupedGemm: picks the grouped point
  std::function<PreparedKernel(const CudaEnv& env, CaseMemory& mem, int n_sets)> prepare;
};

class KernelRegistry {
 public:
  void add(KernelCase c) { cases_.push_back(std::move(c)); }
  const std::vector<KernelCase>& cases() const { return cases_; }

 private:
  std::vector<KernelCase> cases_;
};

// K3 shapes (hidden 7168, 96 heads, KDA head 128, latent 3584, expert inter 3072, 56 local experts top-16, MLA latent
// 512 + 64, vocab 163840) at decode batches 1 / 16 / 64 and prefill token counts; quick: fewer sizes.
void register_dense_cases(KernelRegistry& r, bool quick);      // linears, lm_head, norms, small ops, sampling
void register_moe_cases(KernelRegistry& r, bool quick);        // router, dispatch, expert FFN, combine
void register_attention_cases(KernelRegistry& r, bool quick);  // MLA, KDA, short conv

// Every registered case.
KernelRegistry all_kernel_cases(bool quick);

}  // namespace bg::bench::cuda

// The kernel-case harness: per case, input sets to rotate past the L2, one timed eager call to size the graph, N
// calls captured into one CUDA graph, the median of several replays divided by N, the graph's kernel nodes inspected,
// and the result as a fraction of the ceilings.
#include <algorithm>
#include <cmath>
#include <memory>

#include "backend/cuda/cuda_check.h"
#include "bench/bench.h"
#include "bench/cuda/bench_kernels.h"
#include "bench/cuda/graph_nodes.h"
#include "bench/cuda/kernel_case.h"
#include "bench/device_bench.h"
#include "core/log.h"

namespace bg::bench::cuda {

void* CaseMemory::zeros(size_t bytes) {
  buffers_.emplace_back(std::max<size_t>(bytes, 16));
  total_ += bytes;
  BG_CUDA_CHECK(cudaMemsetAsync(buffers_.back().data(), 0, buffers_.back().bytes(), stream_));
  return buffers_.back().data();
}

__nv_bfloat16* CaseMemory::bf16(size_t n, float scale) {
  auto* p = zeros_of<__nv_bfloat16>(n);
  fill_uniform_bf16(p, n, -scale, scale, seed_++, stream_);
  return p;
}

float* CaseMemory::f32(size_t n, float lo, float hi) {
  auto* p = zeros_of<float>(n);
  fill_uniform_f32(p, n, lo, hi, seed_++, stream_);
  return p;
}

uint8_t* CaseMemory::bytes(size_t n) {
  auto* p = zeros_of<uint8_t>(n);
  fill_random_bytes(p, n, seed_++, stream_);
  return p;
}

uint8_t* CaseMemory::fp8(size_t n) {
  auto* p = zeros_of<uint8_t>(n);
  fill_fp8_e4m3(p, n, seed_++, stream_);
  return p;
}

uint8_t* CaseMemory::e8m0(size_t n) {
  auto* p = zeros_of<uint8_t>(n);
  fill_u8_range(p, n, 127 - 9, 127 - 5, seed_++, stream_);
  return p;
}

namespace {

constexpr int kMaxSets = 64;
constexpr double kMaxSetMemory = 16.0 * (1ull << 30);

// Events around one stream interval, destroyed with the object.
class EventPair {
 public:
  EventPair() {
    BG_CUDA_CHECK(cudaEventCreate(&start_));
    BG_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  template <typename Fn>
  double time_ms(cudaStream_t s, Fn&& fn) {
    BG_CUDA_CHECK(cudaEventRecord(start_, s));
    fn();
    BG_CUDA_CHECK(cudaEventRecord(stop_, s));
    BG_CUDA_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    BG_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

// An instantiated graph of `copies` launches cycling through the input sets; owns graph and executable.
class CaseGraph {
 public:
  CaseGraph(const PreparedKernel& k, int copies, int n_sets, cudaStream_t stream) {
    BG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    try {
      for (int i = 0; i < copies; ++i) k.launch(i % n_sets, stream);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph_);
      if (graph_ != nullptr) cudaGraphDestroy(graph_);
      graph_ = nullptr;
      throw;
    }
    BG_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    BG_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CaseGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CaseGraph(const CaseGraph&) = delete;
  CaseGraph& operator=(const CaseGraph&) = delete;
  cudaGraph_t graph() const { return graph_; }
  void launch(cudaStream_t stream) const { BG_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

int sets_for(const KernelCase& c, int64_t l2_bytes) {
  if (c.set_bytes <= 0) return 1;
  const double want = std::ceil(2.0 * static_cast<double>(l2_bytes) / c.set_bytes);
  const double cap = std::max(1.0, std::floor(kMaxSetMemory / c.set_bytes));
  return static_cast<int>(std::clamp(want, 1.0, std::min<double>(kMaxSets, cap)));
}

// The compute rate a compute-bound case is held to.
std::pair<double, std::string> compute_ref(const KernelCase& c, const Ceilings& ceilings) {
  if (c.compute_ref == ComputeRef::kGroupedGemm && !ceilings.grouped_gemm_bf16.empty()) {
    const GroupedGemmPoint* best = &ceilings.grouped_gemm_bf16.front();
    for (const GroupedGemmPoint& g : ceilings.grouped_gemm_bf16) {
      const auto dist = [&](const GroupedGemmPoint& p) {
        return std::abs(std::log(static_cast<double>(p.rows_per_expert)) -
                        std::log(static_cast<double>(std::max<int64_t>(c.rows_per_expert, 1))));
      };
      if (dist(g) < dist(*best)) best = &g;
    }
    return {best->tflops, "grouped_gemm_bf16"};
  }
  return {ceilings.compute_tflops(), "gemm_bf16"};
}

void fill_resources(KernelResult& r) {
  const LaunchInfo* widest = nullptr;
  for (const LaunchInfo& l : r.launches) {
    if (widest == nullptr || l.grid * l.block > widest->grid * widest->block) widest = &l;
  }
  if (widest == nullptr) return;
  r.registers = widest->registers;
  if (widest->static_smem) r.smem = *widest->static_smem + widest->dynamic_smem;
  r.occupancy = widest->blocks_per_sm;
}

KernelResult run_case(const CudaEnv& env, const KernelCase& c, const Ceilings& ceilings, bool quick) {
  const int n_sets = sets_for(c, env.l2_bytes);
  CaseMemory mem(env.stream);
  const PreparedKernel k = c.prepare(env, mem, n_sets);
  BG_CHECK(static_cast<bool>(k.launch), "bench kernel {}: prepare returned no launch", c.name);
  BG_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  EventPair ev;
  k.launch(0, env.stream);  // first use: lazy initialisation stays out of the timing
  BG_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  const double single_ms = ev.time_ms(env.stream, [&] { k.launch(n_sets > 1 ? 1 : 0, env.stream); });
  // Enough copies for a graph of ~10 ms (quick: 2 ms), so launch gaps and timer resolution vanish; at least one
  // pass over the sets.
  const double target_ms = quick ? 2.0 : 10.0;
  const int copies = static_cast<int>(
      std::clamp(std::round(target_ms / std::max(single_ms, 1e-4)), static_cast<double>(n_sets), 512.0));
  CaseGraph graph(k, copies, n_sets, env.stream);
  KernelResult r;
  r.name = c.name;
  r.shape = c.shape;
  r.copies = copies;
  r.sets = n_sets;
  r.launches = inspect_kernel_nodes(graph.graph());
  graph.launch(env.stream);  // warm-up replay
  BG_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  std::vector<double> replays;
  const int n_replays = single_ms * copies > 1000.0 ? 1 : (quick ? 3 : 7);
  for (int i = 0; i < n_replays; ++i) replays.push_back(ev.time_ms(env.stream, [&] { graph.launch(env.stream); }));
  r.ms = median(replays) / copies;
  r.bytes = k.cost.bytes;
  r.flops = k.cost.flops;
  r.gbps = r.bytes / (r.ms * 1e6);
  r.tflops = r.flops / (r.ms * 1e9);
  const auto [tflops_ref, ref_name] = compute_ref(c, ceilings);
  const double read_ms = ceilings.memory_gbps() > 0 ? r.bytes / (ceilings.memory_gbps() * 1e6) : 0.0;
  const double compute_ms = tflops_ref > 0 ? r.flops / (tflops_ref * 1e9) : 0.0;
  r.bound = read_ms >= compute_ms ? "memory" : "compute";
  r.compute_ref = ref_name;
  r.fraction = std::max(read_ms, compute_ms) / r.ms;
  fill_resources(r);
  return r;
}

}  // namespace

std::vector<KernelResult> run_kernel_cases(const CudaEnv& env, const Ceilings& c, bool quick,
                                           const std::string& filter) {
  const KernelRegistry registry = all_kernel_cases(quick);
  std::vector<KernelResult> out;
  for (const KernelCase& k : registry.cases()) {
    if (!kernel_case_matches(k.name, filter)) continue;
    try {
      out.push_back(run_case(env, k, c, quick));
    } catch (const std::exception& e) {
      // A case that cannot run (a launcher rejecting the shape) is recorded and the rest go on; a fault that broke
      // the CUDA context ends the run, naming the case.
      const cudaError_t sticky = cudaDeviceSynchronize();
      BG_CHECK(sticky == cudaSuccess, "bench kernel {} [{}] broke the CUDA context ({}): {}", k.name, k.shape,
               cudaGetErrorString(sticky), e.what());
      cudaGetLastError();
      log::error("bench kernel {} [{}] failed: {}", k.name, k.shape, e.what());
      KernelResult failed;
      failed.name = k.name;
      failed.shape = k.shape;
      failed.error = e.what();
      out.push_back(std::move(failed));
      continue;
    }
    const KernelResult& r = out.back();
    log::info("bench kernel {} [{}]: {:.4f} ms, {:.0f} GB/s, {:.1f} TFLOP/s, {:.3f} of {} ({} copies, {} sets)",
              r.name, r.shape, r.ms, r.gbps, r.tflops, r.fraction, r.bound, r.copies, r.sets);
  }
  BG_CHECK(!out.empty() || filter.empty(), "bench: no kernel case matches --kernels '{}'", filter);
  return out;
}

KernelRegistry all_kernel_cases(bool quick) {
  KernelRegistry r;
  register_dense_cases(r, quick);
  register_moe_cases(r, quick);
  register_attention_cases(r, quick);
  return r;
}

}  // namespace bg::bench::cuda

// The CUDA ceilings every later figure is a fraction of, measured in the same run: read and copy rates of plain SM
// kernels, cuBLAS bf16 and cuBLASLt FP8 GEMMs at 8192^3, a bf16 grouped GEMM over the 56 K3 experts of one EP16 rank
// at several rows per expert, pinned H2D / D2H, and the cost of one empty kernel node in a replayed graph.
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_buffer.h"
#include "bench/cuda/bench_kernels.h"
#include "bench/cuda/cuda_bench_parts.h"
#include "core/log.h"

namespace bg::bench::cuda {
namespace {

using bg::cuda::DeviceBuffer;

// Best of several grid sizes (waves of 4..32 CTAs of 512 threads per SM) over a 4 GiB buffer, far beyond the L2.
double read_gbps(const CudaEnv& env, bool quick) {
  const size_t bytes = quick ? (size_t{1} << 30) : (size_t{4} << 30);
  DeviceBuffer buf(bytes), sink(sizeof(uint4));
  BG_CUDA_CHECK(cudaMemsetAsync(buf.data(), 1, bytes, env.stream));
  double best_gbps = 0;
  for (int per_sm : {4, 8, 16, 32}) {
    const int grid = static_cast<int>(env.n_sms) * per_sm;
    const double ms = best_ms(env.stream, quick ? 3 : 5, [&] {
      launch_read(buf.as<uint4>(), bytes / sizeof(uint4), sink.as<uint4>(), grid, env.stream);
    });
    best_gbps = std::max(best_gbps, static_cast<double>(bytes) / (ms * 1e6));
  }
  return best_gbps;
}

// An SM copy kernel (not cudaMemcpy, which may use the copy engines): bytes read + written per second.
double copy_gbps(const CudaEnv& env, bool quick) {
  const size_t bytes = quick ? (size_t{512} << 20) : (size_t{2} << 30);
  DeviceBuffer src(bytes), dst(bytes);
  BG_CUDA_CHECK(cudaMemsetAsync(src.data(), 1, bytes, env.stream));
  double best_gbps = 0;
  for (int per_sm : {4, 8, 16}) {
    const int grid = static_cast<int>(env.n_sms) * per_sm;
    const double ms = best_ms(env.stream, quick ? 3 : 5, [&] {
      launch_copy(src.as<uint4>(), dst.as<uint4>(), bytes / sizeof(uint4), grid, env.stream);
    });
    best_gbps = std::max(best_gbps, 2.0 * static_cast<double>(bytes) / (ms * 1e6));
  }
  return best_gbps;
}

// y[rows, out] = x[rows, in] W^T for row-major bf16 operands (column-major: W^T is op T of W's storage).
void gemm_bf16(const CudaEnv& env, int64_t rows, int64_t out, int64_t in, const void* w, const void* x, void* y) {
  const float alpha = 1.0f, beta = 0.0f;
  BG_CUBLAS_CHECK(cublasGemmEx(env.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(rows),
                               static_cast<int>(in), &alpha, w, CUDA_R_16BF, static_cast<int>(in), x, CUDA_R_16BF,
                               static_cast<int>(in), &beta, y, CUDA_R_16BF, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
}

double gemm_bf16_tflops(const CudaEnv& env, bool quick) {
  const int64_t n = 8192;
  DeviceBuffer a(n * n * 2), b(n * n * 2), c(n * n * 2);
  fill_uniform_bf16(a.as<__nv_bfloat16>(), n * n, -1.0f, 1.0f, 1, env.stream);
  fill_uniform_bf16(b.as<__nv_bfloat16>(), n * n, -1.0f, 1.0f, 2, env.stream);
  const double ms = best_ms(env.stream, quick ? 3 : 10, [&] { gemm_bf16(env, n, n, n, a.data(), b.data(), c.data()); });
  return 2.0 * static_cast<double>(n * n) * static_cast<double>(n) / (ms * 1e9);
}

// cuBLASLt E4M3 x E4M3 -> bf16 at 8192^3 in the layout FP8 requires (A transposed, "TN"), unit scales.
double gemm_fp8_tflops(const CudaEnv& env, bool quick) {
  const int64_t n = 8192;
  DeviceBuffer a(n * n), b(n * n), d(n * n * 2);
  fill_fp8_e4m3(a.as<uint8_t>(), n * n, 3, env.stream);
  fill_fp8_e4m3(b.as<uint8_t>(), n * n, 4, env.stream);
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  double tflops = 0;
  try {
    BG_CUBLAS_CHECK(cublasLtCreate(&lt));
    BG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    BG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    BG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
    const auto un = static_cast<uint64_t>(n);
    BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, un, un, n));
    BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, un, un, n));
    BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, un, un, n));
    BG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = env.cublas_workspace_bytes;
    BG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                         sizeof ws));
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    BG_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &heuristic, &found));
    BG_CHECK(found > 0, "bench: cuBLASLt has no FP8 E4M3 algorithm for 8192^3 on this GPU");
    const float alpha = 1.0f, beta = 0.0f;
    const double ms = best_ms(env.stream, quick ? 3 : 10, [&] {
      BG_CUBLAS_CHECK(cublasLtMatmul(lt, desc, &alpha, a.data(), la, b.data(), lb, &beta, d.data(), ld, d.data(), ld,
                                     &heuristic.algo, env.cublas_workspace, ws, env.stream));
    });
    tflops = 2.0 * static_cast<double>(n * n) * static_cast<double>(n) / (ms * 1e9);
  } catch (...) {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    for (auto* l : {la, lb, ld}) if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    if (lt != nullptr) cublasLtDestroy(lt);
    throw;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  for (auto* l : {la, lb, ld}) cublasLtMatrixLayoutDestroy(l);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  return tflops;
}

// Pinned host <-> device over a 1 GiB buffer.
std::pair<double, double> pinned_gbps(const CudaEnv& env, bool quick) {
  const size_t bytes = quick ? (size_t{256} << 20) : (size_t{1} << 30);
  void* host = nullptr;
  BG_CUDA_CHECK(cudaMallocHost(&host, bytes));
  std::pair<double, double> out;
  try {
    DeviceBuffer dev(bytes);
    const double h2d = best_ms(env.stream, 3, [&] {
      BG_CUDA_CHECK(cudaMemcpyAsync(dev.data(), host, bytes, cudaMemcpyHostToDevice, env.stream));
    });
    const double d2h = best_ms(env.stream, 3, [&] {
      BG_CUDA_CHECK(cudaMemcpyAsync(host, dev.data(), bytes, cudaMemcpyDeviceToHost, env.stream));
    });
    out = {static_cast<double>(bytes) / (h2d * 1e6), static_cast<double>(bytes) / (d2h * 1e6)};
  } catch (...) {
    cudaFreeHost(host);
    throw;
  }
  BG_CUDA_CHECK(cudaFreeHost(host));
  return out;
}

// Microseconds per empty kernel node in a replayed graph of many.
double graph_node_us(const CudaEnv& env, bool quick) {
  const int n_nodes = quick ? 200 : 2000;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BG_CUDA_CHECK(cudaStreamBeginCapture(env.stream, cudaStreamCaptureModeRelaxed));
  try {
    for (int i = 0; i < n_nodes; ++i) launch_empty(env.stream);
  } catch (...) {
    cudaStreamEndCapture(env.stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  BG_CUDA_CHECK(cudaStreamEndCapture(env.stream, &graph));
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  BG_CUDA_CHECK(err);
  double ms = 0;
  try {
    ms = best_ms(env.stream, 5, [&] { BG_CUDA_CHECK(cudaGraphLaunch(exec, env.stream)); });
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  BG_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return ms * 1e3 / n_nodes;
}

}  // namespace

double best_ms(cudaStream_t stream, int reps, const std::function<void()>& fn) {
  cudaEvent_t start = nullptr, stop = nullptr;
  BG_CUDA_CHECK(cudaEventCreate(&start));
  BG_CUDA_CHECK(cudaEventCreate(&stop));
  fn();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    BG_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    BG_CUDA_CHECK(cudaEventRecord(stop, stream));
    BG_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    BG_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, static_cast<double>(ms));
  }
  BG_CUDA_CHECK(cudaEventDestroy(start));
  BG_CUDA_CHECK(cudaEventDestroy(stop));
  return best;
}

Ceilings measure_cuda_ceilings(const CudaEnv& env, bool quick) {
  Ceilings c;
  c.read_gbps = read_gbps(env, quick);
  c.copy_gbps = copy_gbps(env, quick);
  log::info("bench ceilings: read {:.0f} GB/s, copy {:.0f} GB/s", *c.read_gbps, *c.copy_gbps);
  c.gemm_bf16_tflops = gemm_bf16_tflops(env, quick);
  try {  // FP8 is a reference for later work, not something the other figures depend on
    c.gemm_fp8_tflops = gemm_fp8_tflops(env, quick);
  } catch (const std::exception& e) {
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    log::warn("bench ceilings: the FP8 GEMM could not run ({}); gemm_fp8_tflops is null", e.what());
  }
  log::info("bench ceilings: GEMM 8192^3 bf16 {:.0f} TFLOP/s, fp8 {:.0f} TFLOP/s", *c.gemm_bf16_tflops,
            c.gemm_fp8_tflops.value_or(0.0));
  c.grouped_gemm_bf16 = measure_grouped_gemm(env, quick);
  const auto [h2d, d2h] = pinned_gbps(env, quick);
  c.h2d_gbps = h2d;
  c.d2h_gbps = d2h;
  c.graph_node_us = graph_node_us(env, quick);
  log::info("bench ceilings: pinned H2D {:.1f} GB/s, D2H {:.1f} GB/s, graph node {:.2f} us", h2d, d2h,
            *c.graph_node_us);
  return c;
}

}  // namespace bg::bench::cuda

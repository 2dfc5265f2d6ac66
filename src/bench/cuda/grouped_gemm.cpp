// The "what bf16 weights could do" reference for the expert FFN: the 56 K3 experts of one EP16 rank as bf16
// (gate|up [6144 x 3584], down [3584 x 3072]) through cuBLAS, at 1 .. 4096 rows per expert. Both cuBLAS entry points
// are timed — cublasGemmGroupedBatchedEx (one group of 56 equal problems) and cublasGemmStridedBatchedEx — and the
// faster is the ceiling: fractions must be against the best library rate, not the worst.
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_buffer.h"
#include "bench/cuda/bench_kernels.h"
#include "bench/cuda/cuda_bench_parts.h"
#include "core/log.h"

namespace bg::bench::cuda {
namespace {

using bg::cuda::DeviceBuffer;

constexpr int kExperts = 56;
constexpr int kLatent = 3584;    // expert input / output width (K3 routed_expert_hidden_size)
constexpr int kInter = 3072;     // expert intermediate width
constexpr int kGateUp = 2 * kInter;

// One expert GEMM shape: y[rows, out] = x[rows, in] W^T, row-major; x rows are ldx elements apart.
struct GemmShape {
  int out, in, ldx;
};

// Device buffers of one row count: weights [56, out, in], activations [56, rows, *].
struct Operands {
  DeviceBuffer w1, w2, x, h, y;
  DeviceBuffer ptrs;  // device pointer arrays for the grouped call: A1, B1, C1, A2, B2, C2 (56 each)
};

void grouped_call(const CudaEnv& env, const GemmShape& s, int rows, const void* const* a, const void* const* b,
                  void* const* c) {
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const int m = s.out, n = rows, k = s.in, lda = s.in, ldb = s.ldx, ldc = s.out, group_size = kExperts;
  const float alpha = 1.0f, beta = 0.0f;
  BG_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(env.cublas, &ta, &tb, &m, &n, &k, &alpha, a, CUDA_R_16BF, &lda, b,
                                             CUDA_R_16BF, &ldb, &beta, c, CUDA_R_16BF, &ldc, 1, &group_size,
                                             CUBLAS_COMPUTE_32F));
}

void strided_call(const CudaEnv& env, const GemmShape& s, int rows, const void* w, const void* x, int64_t x_stride,
                  void* y) {
  const float alpha = 1.0f, beta = 0.0f;
  BG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      env.cublas, CUBLAS_OP_T, CUBLAS_OP_N, s.out, rows, s.in, &alpha, w, CUDA_R_16BF, s.in,
      static_cast<int64_t>(s.out) * s.in, x, CUDA_R_16BF, s.ldx, x_stride, &beta, y, CUDA_R_16BF, s.out,
      static_cast<int64_t>(rows) * s.out, kExperts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

GroupedGemmPoint measure_rows(const CudaEnv& env, const Operands& o, int rows, bool quick) {
  const GemmShape gate_up{kGateUp, kLatent, kLatent}, down{kLatent, kInter, kGateUp};  // down reads h's first half
  const auto r = static_cast<int64_t>(rows);
  // Pointer arrays for the grouped call, per expert e: gate|up (W1_e, x_e, h_e), down (W2_e, h_e, y_e).
  std::vector<const void*> host(6 * kExperts);
  for (int e = 0; e < kExperts; ++e) {
    const auto i = static_cast<size_t>(e);
    host[i] = o.w1.as<__nv_bfloat16>() + int64_t{e} * kGateUp * kLatent;
    host[kExperts + i] = o.x.as<__nv_bfloat16>() + e * r * kLatent;
    host[2 * kExperts + i] = o.h.as<__nv_bfloat16>() + e * r * kGateUp;
    host[3 * kExperts + i] = o.w2.as<__nv_bfloat16>() + int64_t{e} * kLatent * kInter;
    host[4 * kExperts + i] = o.h.as<__nv_bfloat16>() + e * r * kGateUp;
    host[5 * kExperts + i] = o.y.as<__nv_bfloat16>() + e * r * kLatent;
  }
  BG_CUDA_CHECK(cudaMemcpy(o.ptrs.data(), host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
  auto* p = o.ptrs.as<void*>();
  const int reps = quick ? 3 : 5;
  const double strided_ms = best_ms(env.stream, reps, [&] {
    strided_call(env, gate_up, rows, o.w1.data(), o.x.data(), r * kLatent, o.h.data());
    strided_call(env, down, rows, o.w2.data(), o.h.data(), r * kGateUp, o.y.data());
  });
  double grouped_ms = 0;
  try {
    grouped_ms = best_ms(env.stream, reps, [&] {
      grouped_call(env, gate_up, rows, p, p + kExperts, p + 2 * kExperts);
      grouped_call(env, down, rows, p + 3 * kExperts, p + 4 * kExperts, p + 5 * kExperts);
    });
  } catch (const std::exception& e) {
    cudaGetLastError();
    log::warn("bench: cublasGemmGroupedBatchedEx failed at {} rows per expert ({}); strided-batched only", rows,
              e.what());
  }
  GroupedGemmPoint g;
  g.rows_per_expert = rows;
  const bool grouped_wins = grouped_ms > 0 && grouped_ms < strided_ms;
  g.ms = grouped_wins ? grouped_ms : strided_ms;
  g.api = grouped_wins ? "grouped" : "strided_batched";
  const double params = static_cast<double>(kExperts) * (double{kGateUp} * kLatent + double{kLatent} * kInter);
  const double acts = static_cast<double>(kExperts) * static_cast<double>(r) * (kLatent + kGateUp + kInter + kLatent);
  g.tflops = 2.0 * params * static_cast<double>(r) / (g.ms * 1e9);
  g.gbps = 2.0 * (params + acts) / (g.ms * 1e6);
  log::info("bench ceilings: grouped bf16 {} rows/expert: strided {:.3f} ms, grouped {:.3f} ms -> {:.1f} TFLOP/s",
            rows, strided_ms, grouped_ms, g.tflops);
  return g;
}

}  // namespace

std::vector<GroupedGemmPoint> measure_grouped_gemm(const CudaEnv& env, bool quick) {
  const std::vector<int> rows = quick ? std::vector<int>{16, 1024} : std::vector<int>{1, 16, 64, 256, 1024, 4096};
  const int64_t max_rows = *std::max_element(rows.begin(), rows.end());
  Operands o;
  o.w1 = DeviceBuffer(size_t{2} * kExperts * kGateUp * kLatent);
  o.w2 = DeviceBuffer(size_t{2} * kExperts * kLatent * kInter);
  o.x = DeviceBuffer(size_t{2} * kExperts * static_cast<size_t>(max_rows) * kLatent);
  o.h = DeviceBuffer(size_t{2} * kExperts * static_cast<size_t>(max_rows) * kGateUp);
  o.y = DeviceBuffer(size_t{2} * kExperts * static_cast<size_t>(max_rows) * kLatent);
  o.ptrs = DeviceBuffer(6 * kExperts * sizeof(void*));
  // Weights of the magnitude of real ones (std ~ 1/sqrt(in)); activations of unit scale.
  fill_uniform_bf16(o.w1.as<__nv_bfloat16>(), o.w1.bytes() / 2, -0.03f, 0.03f, 21, env.stream);
  fill_uniform_bf16(o.w2.as<__nv_bfloat16>(), o.w2.bytes() / 2, -0.03f, 0.03f, 22, env.stream);
  fill_uniform_bf16(o.x.as<__nv_bfloat16>(), o.x.bytes() / 2, -1.0f, 1.0f, 23, env.stream);
  BG_CUDA_CHECK(cudaStreamSynchronize(env.stream));
  std::vector<GroupedGemmPoint> out;
  for (int r : rows) out.push_back(measure_rows(env, o, r, quick));
  return out;
}

}  // namespace bg::bench::cuda

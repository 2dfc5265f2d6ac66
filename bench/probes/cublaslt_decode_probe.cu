// Probe (not part of the build): how far cuBLASLt's own candidate algorithms take the dense decode GEMMs whose
// default cublasGemmEx algorithm leaves SMs idle (bench/h200.json launch records: 92-104 CTAs at 64 tokens).
// For each shape y[M, N] = x[M, K] W[N, K]^T (bf16 in and out, fp32 compute) and M in {1, 16, 64}: the default
// cublasGemmEx, then every algorithm cublasLtMatmulAlgoGetHeuristic returns (up to 32), each timed over 40 launches
// after a warm-up; GB/s on the weight bytes beside a uint4 read of a 4 GiB buffer in the same run.
// Build: nvcc -O3 -std=c++17 -arch=sm_90a bench/probes/cublaslt_decode_probe.cu -lcublasLt -lcublas -o probe
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    auto e_ = (x);                                                                     \
    if (static_cast<int>(e_) != 0) {                                                   \
      std::printf("error %d at %s:%d: %s\n", static_cast<int>(e_), __FILE__, __LINE__, #x); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__global__ void read_kernel(const uint4* p, size_t n, uint4* sink) {
  uint4 acc = {0, 0, 0, 0};
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = p[i];
    acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
  }
  if (acc.x == 0x12345678u) *sink = acc;
}

template <class F>
float time_ms(F f, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return ms / reps;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t big = size_t(4) << 30;
  void* buf = nullptr;
  CK(cudaMalloc(&buf, big));
  CK(cudaMemset(buf, 1, big));
  uint4* sink = nullptr;
  CK(cudaMalloc(&sink, sizeof(uint4)));
  const float read_ms = time_ms([&] { read_kernel<<<sms * 8, 512>>>(static_cast<uint4*>(buf), big / 16, sink); }, 5);
  const double read_gbps = big / (read_ms * 1e6);
  std::printf("read ceiling %.0f GB/s (%d SMs)\n", read_gbps, sms);

  cublasHandle_t h;
  CK(cublasCreate(&h));
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  void* ws = nullptr;
  const size_t ws_bytes = size_t(64) << 20;
  CK(cudaMalloc(&ws, ws_bytes));
  CK(cublasSetWorkspace(h, ws, ws_bytes));

  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"o_proj", 7168, 12288}, {"latent_up", 7168, 3584}, {"shared_down", 7168, 6144},
                          {"mla_q_b", 18432, 1536}, {"lm_head", 163840, 7168}};
  auto* base = static_cast<__nv_bfloat16*>(buf);
  for (const Shape& s : shapes) {
    const __nv_bfloat16* w = base;  // weights: the first n*k of the buffer (>= 22 MB; all but mla_q_b exceed L2)
    __nv_bfloat16* x = base + size_t(s.n) * s.k;
    __nv_bfloat16* y = x + size_t(64) * s.k;
    const double wbytes = 2.0 * s.n * s.k;
    for (int m : {1, 16, 64}) {
      const float alpha = 1.0f, beta = 0.0f;
      const float def = time_ms([&] {
        CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.n, m, s.k, &alpha, w, CUDA_R_16BF, s.k, x, CUDA_R_16BF, s.k,
                        &beta, y, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      }, 40);
      cublasLtMatmulDesc_t desc;
      CK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
      CK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
      cublasLtMatrixLayout_t la, lb, lc;
      CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k));
      CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, m, s.k));
      CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.n, m, s.n));
      cublasLtMatmulPreference_t pref;
      CK(cublasLtMatmulPreferenceCreate(&pref));
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                              sizeof(ws_bytes)));
      cublasLtMatmulHeuristicResult_t res[32];
      int n_res = 0;
      CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 32, res, &n_res));
      float best = 1e30f, first = 0;
      int best_i = -1;
      for (int i = 0; i < n_res; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        const float t = time_ms([&] {
          CK(cublasLtMatmul(lt, desc, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &res[i].algo, ws, ws_bytes, 0));
        }, 40);
        if (i == 0) first = t;
        if (t < best) best = t, best_i = i;
      }
      std::printf("%-12s M=%-3d default %.4f ms (%.3f of read) | lt first %.4f (%.3f) | lt best #%d of %d %.4f ms "
                  "(%.3f)\n",
                  s.name, m, def, wbytes / (def * 1e6) / read_gbps, first, wbytes / (first * 1e6) / read_gbps,
                  best_i, n_res, best, wbytes / (best * 1e6) / read_gbps);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(desc);
    }
  }
  return 0;
}

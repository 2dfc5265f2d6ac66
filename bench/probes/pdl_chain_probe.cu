// Probe: what programmatic dependent launch saves per kernel boundary in a CUDA graph of small dependent kernels
// (the decode step's small ops). A chain of N kernels, each reading the previous one's output row and writing its own
// (one block of 256 threads, or `blocks` blocks), captured into a graph without and with the PDL attribute (every
// kernel waits on griddepcontrol.wait first, so each still sees its predecessor's writes), the PDL runs once with no
// trigger (the dependents launch when a grid ends) and once with griddepcontrol.launch_dependents at each kernel's
// start (the next grid's CTAs are resident and waiting while this one runs). Prints us per kernel.
//   nvcc -O3 -arch=sm_90a -std=c++20 bench/probes/pdl_chain_probe.cu -o pdl_chain_probe && ./pdl_chain_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      std::printf("%s failed: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__); \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

// mode 0: plain launches; 1: PDL, no trigger; 2: PDL, each kernel triggers its dependents at its start.
__global__ void step_kernel(const float* in, float* out, int n, int mode) {
  if (mode == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (mode != 0) asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = in[i] * 1.0001f + 1.0f;
  }
}

int run(int n_kernels, int blocks, int n, int mode, float* ms_out) {
  float *a = nullptr, *b = nullptr;
  CHECK(cudaMalloc(&a, n * sizeof(float)));
  CHECK(cudaMalloc(&b, n * sizeof(float)));
  CHECK(cudaMemset(a, 0, n * sizeof(float)));
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaGraph_t g;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < n_kernels; ++k) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(256);
    cfg.stream = s;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = mode != 0 && k > 0 ? 1 : 0;
    const float* in = k % 2 == 0 ? a : b;
    float* out = k % 2 == 0 ? b : a;
    CHECK(cudaLaunchKernelEx(&cfg, step_kernel, in, out, n, mode));
  }
  CHECK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaStreamSynchronize(s));
  std::vector<float> t;
  for (int r = 0; r < 7; ++r) {
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  std::vector<float> sorted = t;
  std::sort(sorted.begin(), sorted.end());
  *ms_out = sorted[sorted.size() / 2];
  // The chain's result: every element went through n_kernels steps (checks that no step was skipped or raced).
  std::vector<float> host(n);
  CHECK(cudaMemcpy(host.data(), n_kernels % 2 == 0 ? a : b, n * sizeof(float), cudaMemcpyDeviceToHost));
  float want = 0.0f;
  for (int r = 0; r < 8 * n_kernels; ++r) want = std::fmaf(want, 1.0001f, 1.0f);  // 1 warm-up + 7 timed launches
  int bad = 0;
  for (int i = 0; i < n; ++i) bad += host[i] != want;
  if (bad != 0) std::printf("  %d of %d values differ from the serial chain's %g (a race)\n", bad, n, want);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaFree(a);
  cudaFree(b);
  cudaStreamDestroy(s);
  return 0;
}

int main() {
  const int n_kernels = 200;
  for (int blocks : {1, 8, 132}) {
    for (int n : {7168, 64 * 7168}) {
      float base = 0, pdl = 0, early = 0;
      if (run(n_kernels, blocks, n, 0, &base) || run(n_kernels, blocks, n, 1, &pdl) ||
          run(n_kernels, blocks, n, 2, &early)) {
        return 1;
      }
      std::printf("blocks %4d, %7d floats: us per kernel: %.2f without PDL, %.2f with, %.2f with early triggers\n",
                  blocks, n, base * 1e3 / n_kernels, pdl * 1e3 / n_kernels, early * 1e3 / n_kernels);
    }
  }
  return 0;
}

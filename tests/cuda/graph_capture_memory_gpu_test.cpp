// Memory during CUDA graph capture on the GPU: a captured graph whose ops allocate and free scratch captures under
// the strictest capture mode (global: a cudaFree or any synchronising call would invalidate it), reuses the scratch
// freed earlier in the capture, defers a cache release until the capture ends, and replays correctly with new inputs
// — through the caching allocator directly and through the CUDA backend's run_graph.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_allocator.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "cuda/cuda_testing.h"
#include "ops/elementwise/elementwise_cuda.h"

namespace bg::testing {
namespace {

using bf16 = __nv_bfloat16;
constexpr int64_t kN = 4096;  // bf16 values per buffer

// bf16(x + y): the reference of out = 0; out += x; out += y.
std::vector<float> sum_ref(const std::vector<float>& x, const std::vector<float>& y) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(x[i] + y[i]));
  return r;
}

TEST(GraphCaptureMemory, ScratchFreedAndAllocatedInsideACaptureReplaysCorrectly) {
  BG_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  BG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto alloc = cuda::make_cuda_allocator(size_t{256} << 20);
  const size_t bytes = kN * sizeof(bf16);
  auto x = alloc->allocate(bytes), y = alloc->allocate(bytes), out = alloc->allocate(bytes);
  alloc->allocate(size_t{1} << 20).reset();  // something cached, for the release below
  ASSERT_GT(alloc->bytes_cached(), 0u);

  std::shared_ptr<CapturePool> pool = alloc->begin_capture();
  BG_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  BG_CUDA_CHECK(cudaMemsetAsync(out.get(), 0, bytes, stream));
  void* first_scratch = nullptr;
  for (const auto& input : {x, y}) {  // one "op" per input: copy into fresh scratch, add, free the scratch
    std::shared_ptr<void> scratch = alloc->allocate(bytes);
    if (first_scratch == nullptr) first_scratch = scratch.get();
    EXPECT_EQ(scratch.get(), first_scratch) << "the scratch freed earlier in the capture is reused";
    BG_CUDA_CHECK(cudaMemcpyAsync(scratch.get(), input.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    ops::add_inplace_cuda(kN, static_cast<const bf16*>(scratch.get()), static_cast<bf16*>(out.get()), stream);
    BG_CUDA_CHECK(cudaGetLastError());
  }
  alloc->release_cache();  // deferred: a cudaFree here would invalidate the capture
  EXPECT_GT(alloc->bytes_cached(), 0u);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  alloc->end_capture();
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorName(ended);
  EXPECT_EQ(alloc->bytes_cached(), 0u) << "the release ran when the capture ended";
  EXPECT_EQ(pool->n_blocks(), 1u);  // one scratch block for both ops
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cudaGraphDestroy(graph);

  // While the graph lives its scratch is not handed out.
  auto other = alloc->allocate(bytes);
  EXPECT_NE(other.get(), first_scratch);
  for (uint64_t replay = 0; replay < 3; ++replay) {
    std::vector<float> xv = random_floats(kN, 1.0f, 10 + replay), yv = random_floats(kN, 1.0f, 20 + replay);
    std::vector<uint16_t> xb = to_bf16(xv), yb = to_bf16(yv);
    BG_CUDA_CHECK(cudaMemcpy(x.get(), xb.data(), bytes, cudaMemcpyHostToDevice));
    BG_CUDA_CHECK(cudaMemcpy(y.get(), yb.data(), bytes, cudaMemcpyHostToDevice));
    BG_CUDA_CHECK(cudaMemset(other.get(), 0xff, bytes));  // would poison the result if it aliased the scratch
    BG_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    BG_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<uint16_t> got(kN);
    BG_CUDA_CHECK(cudaMemcpy(got.data(), out.get(), bytes, cudaMemcpyDeviceToHost));
    EXPECT_LE(max_rel_error(from_bf16(got), sum_ref(xv, yv)), 1e-2) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  pool.reset();  // the graph is gone: its scratch returns to the cache
  EXPECT_EQ(alloc->allocate(bytes).get(), first_scratch);
  other.reset();
  BG_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GraphCaptureMemory, BackendGraphWithScratchTensorsReplaysCorrectly) {
  BG_REQUIRE_GPU();
  std::unique_ptr<Backend> be = make_cuda_backend();
  Tensor x = be->alloc({kN}, DType::kBF16), y = be->alloc({kN}, DType::kBF16);
  auto body = [&] {
    Tensor out = be->alloc({kN}, DType::kBF16);
    be->fill_zero(out);
    for (const Tensor* input : {&x, &y}) {
      Tensor scratch = be->alloc({kN}, DType::kBF16);  // freed at the end of each iteration, inside the capture
      be->copy(*input, scratch);
      be->add(out, scratch);
    }
    return out;
  };
  for (uint64_t step = 0; step < 4; ++step) {
    std::vector<float> xv = random_floats(kN, 1.0f, 30 + step), yv = random_floats(kN, 1.0f, 40 + step);
    std::vector<uint16_t> xb = to_bf16(xv), yb = to_bf16(yv);
    be->write_bytes(x, std::as_bytes(std::span(xb)));
    be->write_bytes(y, std::as_bytes(std::span(yb)));
    Tensor out = be->run_graph(7, body);  // captured at step 0, replayed after
    std::vector<float> got(kN);
    be->download_f32(out, got.data());
    EXPECT_LE(max_rel_error(got, sum_ref(xv, yv)), 1e-2) << "step " << step;
  }
  EXPECT_EQ(be->n_graphs(), 1);
}

}  // namespace
}  // namespace bg::testing

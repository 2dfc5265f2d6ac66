// Memory during CUDA graph capture on the GPU: a captured graph whose ops allocate and free scratch captures under
// the strictest capture mode (global: a cudaFree or any synchronising call would invalidate it), reuses the scratch
// freed earlier in the capture, defers a cache release until the capture ends, and replays correctly with new inputs
// — through the caching allocator directly and through the CUDA backend's run_graph.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <cstdlib>
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

// BG_GRAPH_ARENA=1: graphs of several keys share one arena and, replayed in any order, each still computes its own
// result; the backend's memory stays at about one graph's peak, not the sum. A capture that keeps an arena block
// past its end (a tensor the body stores outside the graph) turns the arena off: every graph is recaptured with a
// pool of its own and still computes right.
TEST(GraphCaptureMemory, DecodeGraphsShareAnArena) {
  BG_REQUIRE_GPU();
  ::setenv("BG_GRAPH_ARENA", "1", 1);
  std::unique_ptr<Backend> be = make_cuda_backend();
  ::unsetenv("BG_GRAPH_ARENA");
  Tensor x = be->alloc({kN}, DType::kBF16), y = be->alloc({kN}, DType::kBF16);
  Tensor stash;  // set by the leaking body: a tensor that outlives its capture
  auto body = [&](int scratch_copies, bool leak) {
    return [&, scratch_copies, leak] {
      Tensor out = be->alloc({kN}, DType::kBF16);
      be->fill_zero(out);
      for (int i = 0; i < scratch_copies; ++i) {
        for (const Tensor* input : {&x, &y}) {
          Tensor scratch = be->alloc({kN}, DType::kBF16);  // freed inside the capture: arena memory
          be->copy(*input, scratch);
          be->add(out, scratch);
        }
      }
      if (leak) {
        stash = be->alloc({kN}, DType::kBF16);
        be->fill_zero(stash);
      }
      return out;
    };
  };
  auto check = [&](int64_t key, int copies, bool leak, uint64_t seed) {
    std::vector<float> xv = random_floats(kN, 1.0f, seed), yv = random_floats(kN, 1.0f, seed + 1);
    std::vector<uint16_t> xb = to_bf16(xv), yb = to_bf16(yv);
    be->write_bytes(x, std::as_bytes(std::span(xb)));
    be->write_bytes(y, std::as_bytes(std::span(yb)));
    Tensor out = be->run_graph(key, body(copies, leak));
    std::vector<float> got(kN), want = sum_ref(xv, yv);
    for (float& w : want) w *= static_cast<float>(copies);
    be->download_f32(out, got.data());
    EXPECT_LE(max_rel_error(got, want), 2e-2) << "graph " << key << " seed " << seed;
  };
  {
    std::vector<float> warm(kN);
    be->download_f32(x, warm.data());  // whatever a download keeps in the cache is there before the measurement
  }
  const size_t before = be->memory_use().held;
  for (uint64_t round = 0; round < 3; ++round) {
    for (int64_t key = 1; key <= 4; ++key) check(key, static_cast<int>(key), false, 100 * round + 10 * key);
  }
  EXPECT_EQ(be->n_graphs(), 4);
  // Four graphs, each needing one output and one scratch block of kN bf16 at a time: with the arena they hold the
  // four outputs and one scratch block between them (5 blocks); a pool each would hold 8.
  const size_t block = static_cast<size_t>(kN) * 2;
  EXPECT_LE(be->memory_use().held - before, 5 * block) << "the graphs' scratch is not shared";
  // A leaking capture: the arena is dropped, every graph recaptured with its own pool, results still right.
  check(5, 2, true, 900);
  EXPECT_EQ(be->n_graphs(), 1) << "the arena's graphs were dropped";
  for (int64_t key = 1; key <= 5; ++key) check(key, key == 5 ? 2 : static_cast<int>(key), key == 5, 1000 + key);
  EXPECT_EQ(be->n_graphs(), 5);
}

}  // namespace
}  // namespace bg::testing

// make_cuda_allocator: the caching allocator's driver is the CUDA runtime of the current device.
#include "backend/cuda/cuda_allocator.h"

#include <utility>

#include "backend/cuda/cuda_check.h"

namespace bg::cuda {
namespace {

class CudaBlockDriver final : public BlockDriver {
 public:
  // cudaMalloc does not synchronise and is legal while a stream is captured, but a thread in global or thread-local
  // capture mode is refused "potentially unsafe" calls: this one runs in relaxed mode (the caller's mode is restored).
  void* malloc(size_t bytes) override {
    void* ptr = nullptr;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    BG_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t err = cudaMalloc(&ptr, bytes);
    BG_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it, the allocator frees its cache and asks again
      return nullptr;
    }
    BG_CUDA_CHECK(err);
    return ptr;
  }
  void free(void* ptr) noexcept override { cudaFree(ptr); }
};

}  // namespace

std::shared_ptr<CachingAllocator> make_cuda_allocator(size_t budget_bytes) {
  if (budget_bytes == 0) {
    size_t free_bytes = 0, total = 0;
    BG_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    budget_bytes = free_bytes;
  }
  return std::make_shared<CachingAllocator>(std::make_shared<CudaBlockDriver>(), budget_bytes);
}

Tensor alloc_tensor(CachingAllocator& alloc, Shape shape, DType dtype) {
  Tensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.device = DeviceKind::kCuda;
  t.owner = alloc.allocate(t.nbytes());
  t.data = t.owner.get();
  return t;
}

Tensor packed_copy(CachingAllocator& alloc, const Tensor& t, cudaStream_t stream) {
  if (t.packed()) return t;
  Tensor out = alloc_tensor(alloc, t.shape, t.dtype);
  const size_t elem = dtype_size_bytes(t.dtype), row = static_cast<size_t>(t.cols()) * elem;
  BG_CUDA_CHECK(cudaMemcpy2DAsync(out.data, row, t.data, static_cast<size_t>(t.ld()) * elem, row,
                                  static_cast<size_t>(t.rows()), cudaMemcpyDeviceToDevice, stream));
  return out;
}

}  // namespace bg::cuda

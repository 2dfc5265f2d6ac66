// The CUDA backend's device allocator: the caching allocator (backend/caching_allocator.h) over cudaMalloc /
// cudaFree. Freed blocks go back to per-size free lists instead of cudaFree (which synchronises the device and is
// illegal while a stream is being captured), so per-step activations cost no driver calls after warm-up.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "backend/caching_allocator.h"
#include "backend/tensor.h"

namespace bg::cuda {

using CachingAllocator = ::bg::CachingAllocator;

// budget_bytes: the most device memory the allocator may hold (cached + in use); 0 = all free memory now.
std::shared_ptr<CachingAllocator> make_cuda_allocator(size_t budget_bytes);

// A device tensor of `shape` with packed rows from the allocator.
Tensor alloc_tensor(CachingAllocator& alloc, Shape shape, DType dtype);
// t itself when its rows are packed; else (a strided view, Tensor::cols_view) a packed copy of it, one 2-D copy on
// `stream`.
Tensor packed_copy(CachingAllocator& alloc, const Tensor& t, cudaStream_t stream);

}  // namespace bg::cuda

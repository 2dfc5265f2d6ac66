// CUDA embedding lookup: one block per token copies (and, for an fp32 table, rounds) one table row; bf16 rows of a
// multiple of 8 in 16-byte units.
#include "ops/embedding/embedding_cuda.h"

#include <cstdint>
#include <type_traits>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

__device__ __forceinline__ bf16 as_bf16(bf16 v) { return v; }
__device__ __forceinline__ bf16 as_bf16(float v) { return cuda_util::to_bf16(v); }

// A bad id gets a NaN row (and raises the flag): true when the block has nothing else to do.
__device__ __forceinline__ bool rejected(const EmbeddingParams& p, int32_t id, bf16* row_out,
                                         int32_t* error_flag) {
  if (id >= 0 && id < p.vocab) return false;
  for (int64_t i = threadIdx.x; i < p.dim; i += blockDim.x) row_out[i] = cuda_util::bf16_nan();
  if (threadIdx.x == 0 && error_flag != nullptr) atomicExch(error_flag, 1);
  return true;
}

// grid (n_tokens), block 256: block t writes out[t, :] (a NaN row for a bad id, which also raises the flag).
template <typename T>
__global__ void embedding_kernel(EmbeddingParams p, const T* table, const int32_t* ids, bf16* out,
                                 int32_t* error_flag) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  bf16* row_out = out + t * p.dim;
  if (rejected(p, id, row_out, error_flag)) return;
  const T* row = table + static_cast<int64_t>(id) * p.dim;
  // kUnroll elements per thread loaded before any is stored: the compiler cannot move a load of the table past a
  // store to out (they might alias), so an element-by-element loop pays a memory latency per element.
  constexpr int kUnroll = 8;
  for (int64_t base = 0; base < p.dim; base += kUnroll * static_cast<int64_t>(blockDim.x)) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < p.dim) v[u] = row[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < p.dim) row_out[i] = as_bf16(v[u]);
    }
  }
}

// bf16 rows whose width is a multiple of 8 (16-byte aligned rows): the same with 16-byte loads, kUnroll per thread.
__global__ void embedding_vec_kernel(EmbeddingParams p, const bf16* table, const int32_t* ids, bf16* out,
                                     int32_t* error_flag) {
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  bf16* row_out = out + t * p.dim;
  if (rejected(p, id, row_out, error_flag)) return;
  const auto* row = reinterpret_cast<const uint4*>(table + static_cast<int64_t>(id) * p.dim);
  auto* dst = reinterpret_cast<uint4*>(row_out);
  const int64_t n_vec = p.dim / 8;
  constexpr int kUnroll = 4;
  for (int64_t base = 0; base < n_vec; base += kUnroll * static_cast<int64_t>(blockDim.x)) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < n_vec) v[u] = __ldg(row + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < n_vec) dst[i] = v[u];
    }
  }
}

template <typename T>
void launch_embedding(const EmbeddingParams& p, const T* table, const int32_t* ids, bf16* out, int32_t* error_flag,
                      cudaStream_t stream) {
  BG_CHECK(p.n_tokens >= 0 && p.vocab > 0 && p.dim > 0, "embedding_cuda: bad shape n_tokens {} vocab {} dim {}",
           p.n_tokens, p.vocab, p.dim);
  BG_CHECK(p.n_tokens < (int64_t{1} << 31), "embedding_cuda: n_tokens {} exceeds the grid", p.n_tokens);
  if (p.n_tokens == 0) return;
  BG_CHECK(table && ids && out, "embedding_cuda: null pointer with n_tokens {}", p.n_tokens);
  const bool aligned = cuda::aligned_to(table, 16) && cuda::aligned_to(out, 16);
  if constexpr (std::is_same_v<T, bf16>) {
    if (aligned && p.dim % 8 == 0) {
      embedding_vec_kernel<<<static_cast<unsigned>(p.n_tokens), 256, 0, stream>>>(p, table, ids, out, error_flag);
      BG_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  embedding_kernel<T><<<static_cast<unsigned>(p.n_tokens), 256, 0, stream>>>(p, table, ids, out, error_flag);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace

void embedding_cuda(const EmbeddingParams& p, const __nv_bfloat16* table, const int32_t* ids, __nv_bfloat16* out,
                    int32_t* error_flag, cudaStream_t stream) {
  launch_embedding(p, table, ids, out, error_flag, stream);
}

void embedding_cuda(const EmbeddingParams& p, const float* table, const int32_t* ids, __nv_bfloat16* out,
                    int32_t* error_flag, cudaStream_t stream) {
  launch_embedding(p, table, ids, out, error_flag, stream);
}

}  // namespace bg::ops

// CUDA RoPE: one block per token; the token's cos / sin table goes to shared memory once, then every (head, pair)
// rotation of the token reads it.
#include "ops/rope/rope_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;
constexpr int64_t kMaxRopeDim = 4096;  // the shared cos / sin table: rope_dim floats

// grid (n_tokens), block 256, dynamic shared [rope_dim] floats: cos in the first half, sin in the second.
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p, const int64_t* positions,
                                                        const float* inv_freq, float attention_factor, bf16* x) {
  extern __shared__ float table[];
  const int64_t half = p.rope_dim / 2;
  float* cos_t = table;
  float* sin_t = table + half;
  const int64_t t = blockIdx.x;
  // fp32 angle, as the CPU reference (and transformers) forms position * inv_freq; full-precision sincosf.
  const float pos = static_cast<float>(positions[t]);
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    cos_t[i] = c * attention_factor;
    sin_t[i] = s * attention_factor;
  }
  __syncthreads();
  bf16* xt = x + t * p.token_stride + p.rope_offset;
  for (int64_t j = threadIdx.x; j < p.n_heads * half; j += blockDim.x) {
    const int64_t h = j / half, i = j - h * half;
    bf16* v = xt + h * p.head_stride;
    const int64_t a = p.interleaved ? 2 * i : i;
    const int64_t b = p.interleaved ? 2 * i + 1 : i + half;
    const float x0 = cuda_util::to_f32(v[a]), x1 = cuda_util::to_f32(v[b]);
    v[a] = cuda_util::to_bf16(x0 * cos_t[i] - x1 * sin_t[i]);
    v[b] = cuda_util::to_bf16(x0 * sin_t[i] + x1 * cos_t[i]);
  }
}

}  // namespace

void apply_rope_cuda(const RopeParams& p, const int64_t* positions, const float* inv_freq, float attention_factor,
                     __nv_bfloat16* x, cudaStream_t stream) {
  BG_CHECK(p.rope_dim > 0 && p.rope_dim % 2 == 0 && p.rope_dim <= kMaxRopeDim,
           "apply_rope_cuda: rope_dim {} must be even and in (0, {}]", p.rope_dim, kMaxRopeDim);
  BG_CHECK(p.n_tokens >= 0 && p.n_tokens < (int64_t{1} << 31), "apply_rope_cuda: bad n_tokens {}", p.n_tokens);
  BG_CHECK(p.n_heads > 0, "apply_rope_cuda: n_heads {} must be positive", p.n_heads);
  BG_CHECK(p.rope_offset >= 0 && p.head_stride >= 0 && p.token_stride >= 0,
           "apply_rope_cuda: negative offset {} or strides (head {}, token {})", p.rope_offset, p.head_stride,
           p.token_stride);
  if (p.n_tokens == 0) return;
  BG_CHECK(positions && inv_freq && x, "apply_rope_cuda: null pointer with n_tokens {}", p.n_tokens);
  const size_t shared_bytes = static_cast<size_t>(p.rope_dim) * sizeof(float);
  rope_kernel<<<static_cast<unsigned>(p.n_tokens), kThreads, shared_bytes, stream>>>(p, positions, inv_freq,
                                                                                    attention_factor, x);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

// CUDA short conv + SiLU. Prefill: for widths up to 4 on 16-byte aligned rows, a thread takes 8 channels over a run
// of kRun tokens with a sliding window in registers (16-byte loads and stores; each input row is read (kRun + W - 1)
// / kRun times instead of W); otherwise one thread per (token, channel) output reads W inputs from x or the old state.
// Both accumulate in the same order, so they give the same bits. Then one thread per channel shifts the state.
// Decode: one thread per (sequence, channel) does both.
#include "ops/short_conv/short_conv_cuda.h"


#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;
constexpr int64_t kMaxKernel = 64;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// Input of token s (relative to the call's first token; s >= -(W-1)) for channel c: x, or the state when s < 0.
__device__ __forceinline__ float input_at(const ShortConvParams& p, const bf16* x, const float* state, int64_t s,
                                          int64_t c) {
  const int64_t n_hist = p.kernel_size - 1;
  return s >= 0 ? cuda_util::to_f32(x[s * p.n_channels + c]) : state[c * n_hist + n_hist + s];
}

// Output element i = t * C + c (channel fastest: coalesced). Reads the old state only; it is updated afterwards.
__global__ void conv_kernel(ShortConvParams p, const bf16* x, const float* weight, const float* state, bf16* out) {
  const int64_t n = p.n_tokens * p.n_channels, w = p.kernel_size;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t t = i / p.n_channels, c = i - t * p.n_channels;
    const float* wc = weight + c * w;
    const int64_t first = t - (w - 1);  // token of weight column 0
    float acc = 0.0f;
    for (int64_t j = 0; j < w; ++j) acc += wc[j] * input_at(p, x, state, first + j, c);
    out[i] = cuda_util::to_bf16(silu(acc));
  }
}

constexpr int kVecChannels = 8;  // one 16-byte row piece of bf16
constexpr int kRun = 16;         // tokens per thread
constexpr int64_t kVecMaxKernel = 4;

union Bf16x8 {
  uint4 raw;
  bf16 v[kVecChannels];
};

// Thread (run r, channel group g): outputs t in [r * kRun, r * kRun + kRun) of channels 8g .. 8g + 7. Channel groups
// are fastest within a block, so a warp's loads of one token row are 512 contiguous bytes.
template <int W>
__global__ void __launch_bounds__(kThreads) conv_vec_kernel(ShortConvParams p, const bf16* x, const float* weight,
                                                            const float* state, bf16* out) {
  const int64_t groups = p.n_channels / kVecChannels;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const int64_t c0 = g * kVecChannels, t0 = static_cast<int64_t>(blockIdx.y) * kRun;
  const int64_t t_end = min(p.n_tokens, t0 + kRun);
  float w[kVecChannels][W];
#pragma unroll
  for (int ch = 0; ch < kVecChannels; ++ch) {
#pragma unroll
    for (int j = 0; j < W; ++j) w[ch][j] = weight[(c0 + ch) * W + j];
  }
  // win[ch][j]: the input of token t - (W - 1) + j for the next output t (j < W - 1 filled before each step).
  float win[kVecChannels][W];
#pragma unroll
  for (int j = 0; j < W - 1; ++j) {
    const int64_t s = t0 - (W - 1) + j;
    if (s >= 0) {
      Bf16x8 in;
      in.raw = *reinterpret_cast<const uint4*>(x + s * p.n_channels + c0);
#pragma unroll
      for (int ch = 0; ch < kVecChannels; ++ch) win[ch][j] = cuda_util::to_f32(in.v[ch]);
    } else {
#pragma unroll
      for (int ch = 0; ch < kVecChannels; ++ch) win[ch][j] = state[(c0 + ch) * (W - 1) + (W - 1) + s];
    }
  }
  for (int64_t t = t0; t < t_end; ++t) {
    Bf16x8 in, o;
    in.raw = *reinterpret_cast<const uint4*>(x + t * p.n_channels + c0);
#pragma unroll
    for (int ch = 0; ch < kVecChannels; ++ch) {
      win[ch][W - 1] = cuda_util::to_f32(in.v[ch]);
      float acc = 0.0f;
#pragma unroll
      for (int j = 0; j < W; ++j) acc += w[ch][j] * win[ch][j];
      o.v[ch] = cuda_util::to_bf16(silu(acc));
#pragma unroll
      for (int j = 0; j + 1 < W; ++j) win[ch][j] = win[ch][j + 1];
    }
    *reinterpret_cast<uint4*>(out + t * p.n_channels + c0) = o.raw;
  }
}

// New state of channel c: the inputs of tokens T-(W-1) .. T-1, oldest first. Entry j reads old entry T+j >= j, so
// ascending j is safe in place.
__global__ void state_kernel(ShortConvParams p, const bf16* x, float* state) {
  const int64_t n_hist = p.kernel_size - 1;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < p.n_channels; c += step) {
    for (int64_t j = 0; j < n_hist; ++j) state[c * n_hist + j] = input_at(p, x, state, p.n_tokens - n_hist + j, c);
  }
}

// Element i = s * C + c: sequence s, channel c. Each thread owns its (slot, channel) state row.
__global__ void decode_kernel(ShortConvDecodeParams p, const bf16* x, const float* weight, ConvStateSlots states,
                              bf16* out) {
  const int64_t n = p.n_seqs * p.n_channels, w = p.kernel_size, n_hist = w - 1;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t s = i / p.n_channels, c = i - s * p.n_channels;
    const int32_t slot = cuda_util::live_slot(states.slot_idx, states.live_tokens, s);
    if (slot < 0) {  // padding: no state to continue
      out[i] = cuda_util::to_bf16(0.0f);
      continue;
    }
    float* st = states.base + slot * states.slot_stride + c * n_hist;  // [W-1], oldest first
    const float* wc = weight + c * w;
    const float xv = cuda_util::to_f32(x[i]);
    float acc = 0.0f;
    for (int64_t j = 0; j < n_hist; ++j) acc += wc[j] * st[j];
    acc += wc[n_hist] * xv;
    out[i] = cuda_util::to_bf16(silu(acc));
    for (int64_t j = 0; j + 1 < n_hist; ++j) st[j] = st[j + 1];
    if (n_hist > 0) st[n_hist - 1] = xv;
  }
}

}  // namespace

bool short_conv_scalar_from_env() { return env_switch("BG_SHORT_CONV_SCALAR", false); }

void short_conv_cuda(const ShortConvParams& p, const __nv_bfloat16* x, const float* weight, float* state,
                     __nv_bfloat16* out, cudaStream_t stream) {
  BG_CHECK(p.n_tokens >= 0, "short_conv_cuda: n_tokens {} is negative", p.n_tokens);
  BG_CHECK(p.n_channels > 0, "short_conv_cuda: n_channels {} must be positive", p.n_channels);
  BG_CHECK(p.kernel_size >= 1 && p.kernel_size <= kMaxKernel, "short_conv_cuda: kernel_size {} outside [1, {}]",
           p.kernel_size, kMaxKernel);
  BG_CHECK(state != nullptr || p.kernel_size == 1, "short_conv_cuda: state is null with kernel_size {}",
           p.kernel_size);
  if (p.n_tokens == 0) return;
  BG_CHECK(x && weight && out, "short_conv_cuda: null x/weight/out with n_tokens {}", p.n_tokens);
  BG_CHECK(static_cast<const void*>(out) != static_cast<const void*>(x), "short_conv_cuda: out aliases x");
  const int64_t n = p.n_tokens * p.n_channels;
  const bool vec = p.kernel_size <= kVecMaxKernel && p.n_channels % kVecChannels == 0 && cuda::aligned_to(x, 16) &&
                   cuda::aligned_to(out, 16) && p.n_tokens <= int64_t{kRun} * 65535 && !short_conv_scalar_from_env();
  if (vec) {
    const int64_t groups = p.n_channels / kVecChannels;
    const dim3 grid(static_cast<unsigned>((groups + kThreads - 1) / kThreads),
                    static_cast<unsigned>((p.n_tokens + kRun - 1) / kRun));
    switch (p.kernel_size) {
      case 1: conv_vec_kernel<1><<<grid, kThreads, 0, stream>>>(p, x, weight, state, out); break;
      case 2: conv_vec_kernel<2><<<grid, kThreads, 0, stream>>>(p, x, weight, state, out); break;
      case 3: conv_vec_kernel<3><<<grid, kThreads, 0, stream>>>(p, x, weight, state, out); break;
      default: conv_vec_kernel<4><<<grid, kThreads, 0, stream>>>(p, x, weight, state, out); break;
    }
  } else {
    conv_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(p, x, weight, state, out);
  }
  BG_CUDA_CHECK_LAUNCH();
  if (p.kernel_size == 1) return;
  state_kernel<<<cuda_util::elementwise_blocks(p.n_channels, kThreads), kThreads, 0, stream>>>(p, x, state);
  BG_CUDA_CHECK_LAUNCH();
}

void short_conv_decode_cuda(const ShortConvDecodeParams& p, const __nv_bfloat16* x, const float* weight,
                            const ConvStateSlots& states, __nv_bfloat16* out, cudaStream_t stream) {
  BG_CHECK(p.n_seqs >= 0, "short_conv_decode_cuda: n_seqs {} is negative", p.n_seqs);
  BG_CHECK(p.n_channels > 0, "short_conv_decode_cuda: n_channels {} must be positive", p.n_channels);
  BG_CHECK(p.kernel_size >= 1 && p.kernel_size <= kMaxKernel, "short_conv_decode_cuda: kernel_size {} outside [1, {}]",
           p.kernel_size, kMaxKernel);
  BG_CHECK(states.slot_stride >= p.n_channels * (p.kernel_size - 1),
           "short_conv_decode_cuda: slot_stride {} below C * (W-1) = {}", states.slot_stride,
           p.n_channels * (p.kernel_size - 1));
  if (p.n_seqs == 0) return;
  BG_CHECK(x && weight && out && states.slot_idx, "short_conv_decode_cuda: null pointer with n_seqs {}", p.n_seqs);
  BG_CHECK(states.base != nullptr || p.kernel_size == 1, "short_conv_decode_cuda: null state base with W {}",
           p.kernel_size);
  BG_CHECK(static_cast<const void*>(out) != static_cast<const void*>(x), "short_conv_decode_cuda: out aliases x");
  const int64_t n = p.n_seqs * p.n_channels;
  decode_kernel<<<cuda_util::elementwise_blocks(n, kThreads), kThreads, 0, stream>>>(p, x, weight, states, out);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

// CUDA short conv + SiLU. Prefill, for widths up to 4 on 16-byte aligned rows: the tiled kernel (default) copies a
// block's tile of 64 + W - 1 input rows by 256 channels into shared memory with cp.async (every row of the tile in
// flight at once), then each thread slides a window in registers over 8 channels by kRun tokens; the rows
// kernel (BG_SHORT_CONV=rows, the one before) does the same window straight from global memory, one 16-byte load in
// flight per thread. Otherwise (or BG_SHORT_CONV=scalar) one thread per (token, channel) output reads W inputs from x
// or the old state. All accumulate in the same order, so they give the same bits. Then one thread per channel shifts
// the state. Decode: one thread per (sequence, channel) does both. The state is bf16: it holds past bf16 inputs only,
// read as floats like x and stored back unchanged.
#include "ops/short_conv/short_conv_cuda.h"


#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/elementwise/cuda_ptx.cuh"
#include "ops/elementwise/cuda_utils.cuh"
#include "ops/kda_gate/kda_gate_cuda.h"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kThreads = 256;
constexpr int64_t kMaxKernel = 64;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// Input of token s (relative to the call's first token; s >= -(W-1)) for channel c: x, or the state when s < 0.
__device__ __forceinline__ float input_at(const ShortConvParams& p, const bf16* x, const bf16* state, int64_t s,
                                          int64_t c) {
  const int64_t n_hist = p.kernel_size - 1;
  return cuda_util::to_f32(s >= 0 ? x[s * p.n_channels + c] : state[c * n_hist + n_hist + s]);
}

// Output element i = t * C + c (channel fastest: coalesced). Reads the old state only; it is updated afterwards.
__global__ void conv_kernel(ShortConvParams p, const bf16* x, const float* weight, const bf16* state, bf16* out) {
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

// The sliding window of the vectorised kernels: win[ch][j] holds the input of token t - (W - 1) + j of channel ch for
// the next output t. window_load sets entry j from an input row, or from the conv state for a token s < 0;
// window_step takes the newest row in, returns the 8 outputs (the same accumulation order as the per-element kernel)
// and shifts the window by one token.
template <int W>
__device__ __forceinline__ void window_load(float (&win)[kVecChannels][W], int j, int64_t s, const Bf16x8& row,
                                            const bf16* state, int64_t c0) {
#pragma unroll
  for (int ch = 0; ch < kVecChannels; ++ch) {
    win[ch][j] = cuda_util::to_f32(s >= 0 ? row.v[ch] : state[(c0 + ch) * (W - 1) + (W - 1) + s]);
  }
}
template <int W>
__device__ __forceinline__ Bf16x8 window_step(float (&win)[kVecChannels][W], const float (&w)[kVecChannels][W],
                                              const Bf16x8& row) {
  Bf16x8 o;
#pragma unroll
  for (int ch = 0; ch < kVecChannels; ++ch) {
    win[ch][W - 1] = cuda_util::to_f32(row.v[ch]);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < W; ++j) acc += w[ch][j] * win[ch][j];
    o.v[ch] = cuda_util::to_bf16(silu(acc));
#pragma unroll
    for (int j = 0; j + 1 < W; ++j) win[ch][j] = win[ch][j + 1];
  }
  return o;
}

// Thread (run r, channel group g): outputs t in [r * kRun, r * kRun + kRun) of channels 8g .. 8g + 7. Channel groups
// are fastest within a block, so a warp's loads of one token row are 512 contiguous bytes.
template <int W>
__global__ void __launch_bounds__(kThreads) conv_vec_kernel(ShortConvParams p, const bf16* x, const float* weight,
                                                            const bf16* state, bf16* out) {
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
  float win[kVecChannels][W];
#pragma unroll
  for (int j = 0; j < W - 1; ++j) {
    const int64_t s = t0 - (W - 1) + j;
    Bf16x8 in{};
    if (s >= 0) in.raw = *reinterpret_cast<const uint4*>(x + s * p.n_channels + c0);
    window_load<W>(win, j, s, in, state, c0);
  }
  for (int64_t t = t0; t < t_end; ++t) {
    Bf16x8 in;
    in.raw = *reinterpret_cast<const uint4*>(x + t * p.n_channels + c0);
    *reinterpret_cast<uint4*>(out + t * p.n_channels + c0) = window_step<W>(win, w, in).raw;
  }
}

// The tiled kernel: block (channel tile, token tile) covers kTileTokens tokens of kTileChannels channels. Shared row
// r holds the input of token t0 - (W - 1) + r (rows before token 0 or past the last one are not copied: the window
// reads the state for the former, and the latter are never read). Thread (group g, run r): channels 8g .. 8g + 7 of
// the tile, tokens r * kRun .. r * kRun + kRun - 1; a warp reads one 512-byte row piece at a time (conflict-free).
constexpr int kTileChannels = kVecChannels * 32;  // one warp's row piece
constexpr int kTileRowBytes = kTileChannels * 2;  // 512
// 4 warps, a 64-token tile (33,280 bytes at W 4), 88 registers: 5 blocks per SM. On the H100 (T 8192, C 12288, W 4)
// 0.220 ms against 0.258 with 8 warps and 128-token tiles (2 blocks per SM: each block's copy phase less hidden).
constexpr int kTileWarps = 4;
constexpr int kTileThreads = kTileWarps * 32;
constexpr int kTileTokens = kTileWarps * kRun;  // a warp per run of kRun tokens
template <int W>
constexpr int tile_smem_bytes() { return (kTileTokens + W - 1) * kTileRowBytes; }
constexpr int kNormSmemBytes = kTileTokens * kTileRowBytes;  // the fused norm's output tile, 32 KiB
constexpr int kMaxNormPerLane = kTileChannels / 32;        // head dims up to 256: 8 elements per lane

// kNorm (short_conv_l2norm_cuda): the outputs go to a second shared tile [kTileTokens][256] instead of memory, then
// each (token, head) row of it gets KDA's q / k L2 norm exactly as kda_l2norm_cuda computes it (a warp per row, lane l
// holding elements l + 32 i, the same fp32 sum, reduction, factor and rounding), so the result is bit for bit the
// conv then the norm, without writing the conv's output and reading it back.
template <int W, bool kNorm>
__global__ void __launch_bounds__(kTileThreads, kNorm ? 3 : 4)
    conv_tiled_kernel(ShortConvParams p, const bf16* __restrict__ x, const float* __restrict__ weight,
                      const bf16* __restrict__ state, ShortConvNorm norm, bf16* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char tile[];
  unsigned char* const res = tile + tile_smem_bytes<W>();  // kNorm: the conv's outputs, [token][channel] bf16
  const int64_t c_tile = static_cast<int64_t>(blockIdx.x) * kTileChannels;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTileTokens;
  constexpr int kRows = kTileTokens + W - 1, kPieces = kTileChannels / kVecChannels;
  for (int i = threadIdx.x; i < kRows * kPieces; i += kTileThreads) {
    const int row = i / kPieces, piece = i - row * kPieces;
    const int64_t s = t0 - (W - 1) + row, c = c_tile + piece * kVecChannels;
    if (s >= 0 && s < p.n_tokens && c < p.n_channels) {
      ptx::cp_async16(ptx::smem_addr(tile + row * kTileRowBytes + piece * 16), x + s * p.n_channels + c);
    }
  }
  ptx::cp_async_commit();
  const int lane = threadIdx.x % 32, run = threadIdx.x / 32;
  const int64_t c0 = c_tile + lane * kVecChannels;
  const bool live = c0 < p.n_channels;
  float w[kVecChannels][W];
#pragma unroll
  for (int ch = 0; ch < kVecChannels; ++ch) {
#pragma unroll
    for (int j = 0; j < W; ++j) w[ch][j] = live ? weight[(c0 + ch) * W + j] : 0.0f;
  }
  ptx::cp_async_wait<0>();
  __syncthreads();
  if (live) {
    const int r0 = run * kRun;  // first output of this thread, relative to t0; its window starts at shared row r0
    const int64_t t_end = min(p.n_tokens - t0, static_cast<int64_t>(r0 + kRun));
    auto row_at = [&](int r) {
      Bf16x8 in;
      in.raw = *reinterpret_cast<const uint4*>(tile + r * kTileRowBytes + lane * 16);
      return in;
    };
    float win[kVecChannels][W];
#pragma unroll
    for (int j = 0; j < W - 1; ++j) {
      const int64_t s = t0 + r0 - (W - 1) + j;
      window_load<W>(win, j, s, s >= 0 ? row_at(r0 + j) : Bf16x8{}, state, c0);
    }
    for (int t = r0; t < t_end; ++t) {
      const uint4 o = window_step<W>(win, w, row_at(t + W - 1)).raw;
      if constexpr (kNorm) {
        *reinterpret_cast<uint4*>(res + t * kTileRowBytes + lane * 16) = o;
      } else {
        *reinterpret_cast<uint4*>(out + (t0 + t) * p.n_channels + c0) = o;
      }
    }
  }
  if constexpr (kNorm) {
    __syncthreads();
    const auto* r16 = reinterpret_cast<const bf16*>(res);
    const int dim = static_cast<int>(norm.head_dim), heads = kTileChannels / dim;
    for (int row = run; row < kTileTokens * heads; row += kTileWarps) {  // warp-uniform
      const int t = row / heads, h = row - t * heads;
      const int64_t c_head = c_tile + static_cast<int64_t>(h) * dim;
      if (t0 + t >= p.n_tokens || c_head >= p.n_channels) continue;
      float v[kMaxNormPerLane];
      float ss = 0.0f;
#pragma unroll
      for (int i = 0; i < kMaxNormPerLane; ++i) {
        const int d = lane + 32 * i;
        v[i] = d < dim ? cuda_util::to_f32(r16[t * kTileChannels + h * dim + d]) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kMaxNormPerLane; ++i) ss += v[i] * v[i];  // zeros past dim change nothing
      ss = cuda_util::warp_reduce(ss, cuda_util::SumOp{});
      const float f = norm.scale / sqrtf(ss + norm.eps);
      bf16* dst = out + (t0 + t) * p.n_channels + c_head;
#pragma unroll
      for (int i = 0; i < kMaxNormPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < dim) dst[d] = cuda_util::to_bf16(v[i] * f);
      }
    }
  }
}

// New state of channel c: the inputs of tokens T-(W-1) .. T-1, oldest first (bf16 values, so rounding them back to bf16
// is exact). Entry j reads old entry T+j >= j, so ascending j is safe in place.
__global__ void state_kernel(ShortConvParams p, const bf16* x, bf16* state) {
  const int64_t n_hist = p.kernel_size - 1;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < p.n_channels; c += step) {
    for (int64_t j = 0; j < n_hist; ++j) {
      state[c * n_hist + j] = cuda_util::to_bf16(input_at(p, x, state, p.n_tokens - n_hist + j, c));
    }
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
    bf16* st = states.base + slot * states.slot_stride + c * n_hist;  // [W-1], oldest first
    const float* wc = weight + c * w;
    const bf16 xb = x[i];
    float acc = 0.0f;
    for (int64_t j = 0; j < n_hist; ++j) acc += wc[j] * cuda_util::to_f32(st[j]);
    acc += wc[n_hist] * cuda_util::to_f32(xb);
    out[i] = cuda_util::to_bf16(silu(acc));
    for (int64_t j = 0; j + 1 < n_hist; ++j) st[j] = st[j + 1];
    if (n_hist > 0) st[n_hist - 1] = xb;
  }
}

}  // namespace

ShortConvKernel short_conv_kernel_from_env() {
  switch (env_choice("BG_SHORT_CONV", {"tiled", "rows", "scalar"})) {
    case 1: return ShortConvKernel::kRows;
    case 2: return ShortConvKernel::kScalar;
    default: return ShortConvKernel::kTiled;
  }
}

namespace {

template <int W, bool kNorm>
void launch_tiled(const ShortConvParams& p, const bf16* x, const float* weight, const bf16* state,
                  const ShortConvNorm& norm, bf16* out, cudaStream_t stream) {
  constexpr int kSmem = tile_smem_bytes<W>() + (kNorm ? kNormSmemBytes : 0);
  if constexpr (kSmem > 48 * 1024) {  // above the default: opt in once per instantiation
    static const bool configured = [] {
      BG_CUDA_CHECK(cudaFuncSetAttribute(conv_tiled_kernel<W, kNorm>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kSmem));
      return true;
    }();
    (void)configured;
  }
  const dim3 grid(static_cast<unsigned>((p.n_channels + kTileChannels - 1) / kTileChannels),
                  static_cast<unsigned>((p.n_tokens + kTileTokens - 1) / kTileTokens));
  conv_tiled_kernel<W, kNorm><<<grid, kTileThreads, kSmem, stream>>>(p, x, weight, state, norm, out);
}

template <int W>
void launch_rows(const ShortConvParams& p, const bf16* x, const float* weight, const bf16* state, bf16* out,
                 cudaStream_t stream) {
  const int64_t groups = p.n_channels / kVecChannels;
  const dim3 grid(static_cast<unsigned>((groups + kThreads - 1) / kThreads),
                  static_cast<unsigned>((p.n_tokens + kRun - 1) / kRun));
  conv_vec_kernel<W><<<grid, kThreads, 0, stream>>>(p, x, weight, state, out);
}

template <int W>
void launch_vectorised(ShortConvKernel kernel, const ShortConvParams& p, const bf16* x, const float* weight,
                       const bf16* state, bf16* out, cudaStream_t stream) {
  if (kernel == ShortConvKernel::kTiled) {
    launch_tiled<W, false>(p, x, weight, state, ShortConvNorm{}, out, stream);
  } else {
    launch_rows<W>(p, x, weight, state, out, stream);
  }
}

}  // namespace

namespace {

// The prefill calls' argument checks, named after the calling function; false when there are no tokens.
bool check_prefill(const char* fn, const ShortConvParams& p, const void* x, const float* weight, const void* state,
                   const void* out) {
  BG_CHECK(p.n_tokens >= 0, "{}: n_tokens {} is negative", fn, p.n_tokens);
  BG_CHECK(p.n_channels > 0, "{}: n_channels {} must be positive", fn, p.n_channels);
  BG_CHECK(p.kernel_size >= 1 && p.kernel_size <= kMaxKernel, "{}: kernel_size {} outside [1, {}]", fn,
           p.kernel_size, kMaxKernel);
  BG_CHECK(state != nullptr || p.kernel_size == 1, "{}: state is null with kernel_size {}", fn, p.kernel_size);
  if (p.n_tokens == 0) return false;
  BG_CHECK(x && weight && out, "{}: null x/weight/out with n_tokens {}", fn, p.n_tokens);
  BG_CHECK(out != x, "{}: out aliases x", fn);
  return true;
}

// Whether a prefill call can take a vectorised kernel (8-channel 16-byte rows, widths up to 4) with grids of
// `tokens_per_block`-token blocks.
bool vectorisable(const ShortConvParams& p, const void* x, const void* out, int64_t tokens_per_block) {
  return p.kernel_size <= kVecMaxKernel && p.n_channels % kVecChannels == 0 && cuda::aligned_to(x, 16) &&
         cuda::aligned_to(out, 16) && p.n_tokens <= tokens_per_block * 65535;
}

// The new conv state (after the outputs were computed from the old one).
void launch_state(const ShortConvParams& p, const bf16* x, bf16* state, cudaStream_t stream) {
  if (p.kernel_size == 1) return;
  state_kernel<<<cuda_util::elementwise_blocks(p.n_channels, kThreads), kThreads, 0, stream>>>(p, x, state);
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace

void short_conv_cuda(const ShortConvParams& p, const __nv_bfloat16* x, const float* weight, __nv_bfloat16* state,
                     __nv_bfloat16* out, cudaStream_t stream) {
  if (!check_prefill("short_conv_cuda", p, x, weight, state, out)) return;
  const ShortConvKernel kernel = short_conv_kernel_from_env();
  if (kernel != ShortConvKernel::kScalar && vectorisable(p, x, out, kRun)) {
    switch (p.kernel_size) {
      case 1: launch_vectorised<1>(kernel, p, x, weight, state, out, stream); break;
      case 2: launch_vectorised<2>(kernel, p, x, weight, state, out, stream); break;
      case 3: launch_vectorised<3>(kernel, p, x, weight, state, out, stream); break;
      default: launch_vectorised<4>(kernel, p, x, weight, state, out, stream); break;
    }
  } else {
    conv_kernel<<<cuda_util::elementwise_blocks(p.n_tokens * p.n_channels, kThreads), kThreads, 0, stream>>>(
        p, x, weight, state, out);
  }
  BG_CUDA_CHECK_LAUNCH();
  launch_state(p, x, state, stream);
}

void short_conv_l2norm_cuda(const ShortConvParams& p, const ShortConvNorm& norm, const __nv_bfloat16* x,
                            const float* weight, __nv_bfloat16* state, __nv_bfloat16* out, cudaStream_t stream) {
  BG_CHECK(norm.head_dim > 0 && p.n_channels % norm.head_dim == 0 && norm.eps > 0.0f,
           "short_conv_l2norm_cuda: head_dim {} must divide the {} channels, eps {} must be positive", norm.head_dim,
           p.n_channels, norm.eps);
  if (!check_prefill("short_conv_l2norm_cuda", p, x, weight, state, out)) return;
  const bool fused = short_conv_kernel_from_env() == ShortConvKernel::kTiled && vectorisable(p, x, out, kTileTokens) &&
                     norm.head_dim % 32 == 0 && kTileChannels % norm.head_dim == 0;
  if (!fused) {
    short_conv_cuda(p, x, weight, state, out, stream);
    kda_l2norm_cuda({p.n_tokens * p.n_channels / norm.head_dim, norm.head_dim, norm.scale, norm.eps}, out, out,
                    stream);
    return;
  }
  switch (p.kernel_size) {
    case 1: launch_tiled<1, true>(p, x, weight, state, norm, out, stream); break;
    case 2: launch_tiled<2, true>(p, x, weight, state, norm, out, stream); break;
    case 3: launch_tiled<3, true>(p, x, weight, state, norm, out, stream); break;
    default: launch_tiled<4, true>(p, x, weight, state, norm, out, stream); break;
  }
  BG_CUDA_CHECK_LAUNCH();
  launch_state(p, x, state, stream);
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

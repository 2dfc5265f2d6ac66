// The fused KDA decode preparation (kda_prep_cuda.h). The L2 norm adds the sums of squares as the warp-per-row L2
// norm does (lane l: channels l, l + 32, ... of its head, then a butterfly). The conv, whose arithmetic does not depend
// on who computes a channel, runs either on that same ownership (any shape) or, for K3's shape (head dim 128, conv
// width 4, 8-byte aligned states, 16-byte aligned weights), on four consecutive channels per lane: 8-byte loads and
// stores of the bf16 conv state (a lane's 12 values, 24 bytes) instead of 2-byte ones at a 6-byte stride, the values
// then handed to the norm's ownership through shared memory. The conv state is bf16: it holds past bf16 inputs only,
// so storing them as bf16 is exact and every result is the fp32-state one.
#include "ops/kda_gate/kda_prep_cuda.h"

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/elementwise/cuda_utils.cuh"

namespace bg::ops {
namespace {

using cuda_util::bf16;

constexpr int kMaxHist = static_cast<int>(kKdaPrepMaxConv) - 1;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Short conv + SiLU of this warp's channels (rounded to bf16 as the conv kernel stores them), the bf16 state shifted by
// one token (the values stored are bf16 inputs, so rounding them is exact). Returns the rounded outputs as floats in v
// (0 for lanes past the head). Every input, weight and state value is loaded before anything is stored (a store could
// alias a later load, so the compiler would not move that load ahead of it), so the warp waits for memory once, not
// once per channel.
template <int kPer>
__device__ __forceinline__ void conv_head(const KdaPrepDecodeParams& p, const bf16* x, const float* weight,
                                          bf16* state, int64_t c0, int lane, float (&v)[kPer]) {
  const int n_hist = static_cast<int>(p.kernel_size) - 1;
  float xv[kPer], wv[kPer][kMaxHist + 1], hist[kPer][kMaxHist];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t d = lane + 32 * i, c = c0 + d;
    xv[i] = d < p.head_dim ? cuda_util::to_f32(x[c]) : 0.0f;
#pragma unroll
    for (int j = 0; j <= kMaxHist; ++j) {
      wv[i][j] = d < p.head_dim && j <= n_hist ? weight[c * p.kernel_size + j] : 0.0f;
      if (j < kMaxHist) hist[i][j] = d < p.head_dim && j < n_hist ? cuda_util::to_f32(state[c * n_hist + j]) : 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t d = lane + 32 * i, c = c0 + d;
    v[i] = 0.0f;
    if (d >= p.head_dim) continue;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxHist; ++j) {
      if (j < n_hist) acc += wv[i][j] * hist[i][j];
    }
#pragma unroll
    for (int j = 0; j <= kMaxHist; ++j) {
      if (j == n_hist) acc += wv[i][j] * xv[i];
    }
    v[i] = cuda_util::to_f32(cuda_util::to_bf16(silu(acc)));
    bf16* st = state + c * n_hist;
#pragma unroll
    for (int j = 0; j + 1 < kMaxHist; ++j) {
      if (j + 1 < n_hist) st[j] = cuda_util::to_bf16(hist[i][j + 1]);
    }
#pragma unroll
    for (int j = 0; j < kMaxHist; ++j) {
      if (j == n_hist - 1) st[j] = cuda_util::to_bf16(xv[i]);
    }
  }
}

// A lane's 12 bf16 history values (4 channels x 3), 24 bytes: three 8-byte pieces (lanes start 24 bytes apart, so
// only 8-byte alignment holds for every lane).
union Bf16x12 {
  uint2 raw[3];
  bf16 v[12];
};

// The conv of conv_head for head dim 128 and width 4 (3 history values), lane l owning channels 4l .. 4l + 3: its
// history is 12 consecutive bf16 (three 8-byte loads), its weights 16 floats (four 16-byte loads), its input 8 bytes.
// The same arithmetic per channel as conv_head. Writes the outputs to sv[4l .. 4l + 3]; the new history is the old
// one's newest two values and the input, moved as bf16 bits (exact).
__device__ __forceinline__ void conv_head_w4x128(const bf16* x, const float* weight, bf16* state, int64_t c0, int lane,
                                                 float* sv) {
  const int64_t c = c0 + 4 * lane;
  const uint2 xr = *reinterpret_cast<const uint2*>(x + c);
  float4 w[4];
  Bf16x12 hist;  // channel i: hist.v[3i .. 3i + 2], oldest first
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = reinterpret_cast<const float4*>(weight + c * 4)[i];
#pragma unroll
  for (int i = 0; i < 3; ++i) hist.raw[i] = reinterpret_cast<const uint2*>(state + c * 3)[i];
  const bf16* xb = reinterpret_cast<const bf16*>(&xr);
  Bf16x12 nh;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float* wi = reinterpret_cast<const float*>(&w[i]);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 3; ++j) acc += wi[j] * cuda_util::to_f32(hist.v[3 * i + j]);
    acc += wi[3] * cuda_util::to_f32(xb[i]);
    sv[4 * lane + i] = cuda_util::to_f32(cuda_util::to_bf16(silu(acc)));
    nh.v[3 * i] = hist.v[3 * i + 1];
    nh.v[3 * i + 1] = hist.v[3 * i + 2];
    nh.v[3 * i + 2] = xb[i];
  }
#pragma unroll
  for (int i = 0; i < 3; ++i) reinterpret_cast<uint2*>(state + c * 3)[i] = nh.raw[i];
}

// grid (H, n_seqs), 128 threads: warp 0 q, 1 k, 2 v, 3 gate and beta. kPer: channels per lane (head_dim <= 32 kPer).
// kW4x128: the conv on conv_head_w4x128 (kPer 4, head dim 128, width 4, aligned: see the launcher).
template <int kPer, bool kW4x128>
__global__ void __launch_bounds__(128) kda_prep_decode_kernel(KdaPrepDecodeParams p, KdaPrepDecodeInputs in,
                                                              KdaPrepDecodeOutputs out) {
  __shared__ float conv_out[3][kW4x128 ? 128 : 1];
  const int64_t h = blockIdx.x, s = blockIdx.y;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t width = p.n_heads * p.head_dim, c0 = h * p.head_dim;
  if (warp == 3) {
    const float a = expf(in.a_log[h]);
    const bf16* gr = in.g_raw + s * in.g_row;
    float* g = out.g + s * width;
    for (int64_t d = lane; d < p.head_dim; d += 32) {
      const int64_t c = c0 + d;
      g[c] = p.lower_bound * sigmoid(a * (cuda_util::to_f32(gr[c]) + in.dt_bias[c]));
    }
    if (lane == 0) out.beta[s * p.n_heads + h] = sigmoid(cuda_util::to_f32(in.b[s * in.b_row + h]));
    return;
  }
  bf16* y = (warp == 0 ? out.q : warp == 1 ? out.k : out.v) + s * width;
  const ConvStateSlots& cs = in.conv_state[warp];
  const int32_t slot = cuda_util::live_slot(cs.slot_idx, cs.live_tokens, s);
  if (slot < 0) {  // padding: no state to continue
    for (int64_t d = lane; d < p.head_dim; d += 32) y[c0 + d] = cuda_util::to_bf16(0.0f);
    return;
  }
  float v[kPer];
  bf16* state = cs.base + slot * cs.slot_stride;
  if constexpr (kW4x128) {
    static_assert(kPer == 4);
    float* sv = conv_out[warp];
    conv_head_w4x128(in.x[warp] + s * in.x_row[warp], in.conv_weight[warp], state, c0, lane, sv);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[i] = sv[lane + 32 * i];
  } else {
    conv_head<kPer>(p, in.x[warp] + s * in.x_row[warp], in.conv_weight[warp], state, c0, lane, v);
  }
  float f = 1.0f;
  if (warp < 2) {  // the L2 norm of kda_l2norm_cuda's warp-per-row kernel: ss over d = lane, lane + 32, ...
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) ss += v[i] * v[i];
    ss = cuda_util::warp_reduce(ss, cuda_util::SumOp{});
    f = (warp == 0 ? p.q_scale : 1.0f) / sqrtf(ss + p.l2_eps);
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < p.head_dim) y[c0 + d] = cuda_util::to_bf16(warp < 2 ? v[i] * f : v[i]);
  }
}

}  // namespace

bool kda_prep_w4x128_enabled() {
  static const bool on = env_switch("BG_KDA_PREP_W4X128", true);
  return on;
}

void kda_prep_decode_cuda(const KdaPrepDecodeParams& p, const KdaPrepDecodeInputs& in, const KdaPrepDecodeOutputs& out,
                          cudaStream_t stream) {
  BG_CHECK(p.n_seqs >= 0 && p.n_seqs < 65536, "kda_prep_decode_cuda: n_seqs {} outside [0, 65535]", p.n_seqs);
  BG_CHECK(p.n_heads > 0 && p.n_heads < (int64_t{1} << 31), "kda_prep_decode_cuda: bad n_heads {}", p.n_heads);
  BG_CHECK(p.head_dim > 0 && p.head_dim <= kKdaPrepMaxHeadDim, "kda_prep_decode_cuda: head_dim {} outside [1, {}]",
           p.head_dim, kKdaPrepMaxHeadDim);
  BG_CHECK(p.kernel_size >= 1 && p.kernel_size <= kMaxHist + 1, "kda_prep_decode_cuda: kernel_size {} outside [1, {}]",
           p.kernel_size, kMaxHist + 1);
  BG_CHECK(p.lower_bound < 0.0f && p.l2_eps > 0.0f, "kda_prep_decode_cuda: lower_bound {} must be < 0 and eps {} > 0",
           p.lower_bound, p.l2_eps);
  if (p.n_seqs == 0) return;
  const int64_t width = p.n_heads * p.head_dim;
  for (int i = 0; i < 3; ++i) {
    BG_CHECK(in.x[i] && in.conv_weight[i] && in.conv_state[i].slot_idx, "kda_prep_decode_cuda: null input {}", i);
    BG_CHECK(in.conv_state[i].base != nullptr || p.kernel_size == 1, "kda_prep_decode_cuda: null conv state {}", i);
    BG_CHECK(in.x_row[i] >= width, "kda_prep_decode_cuda: row stride {} of input {} below {}", in.x_row[i], i, width);
    BG_CHECK(in.conv_state[i].slot_stride >= width * (p.kernel_size - 1),
             "kda_prep_decode_cuda: conv state stride {} below C * (W-1) = {}", in.conv_state[i].slot_stride,
             width * (p.kernel_size - 1));
  }
  BG_CHECK(in.g_raw && in.a_log && in.dt_bias && in.b, "kda_prep_decode_cuda: null gate or beta input");
  BG_CHECK(in.g_row >= width && in.b_row >= p.n_heads, "kda_prep_decode_cuda: row strides g {} b {} too small",
           in.g_row, in.b_row);
  BG_CHECK(out.q && out.k && out.v && out.g && out.beta, "kda_prep_decode_cuda: null output");
  const dim3 grid(static_cast<unsigned>(p.n_heads), static_cast<unsigned>(p.n_seqs));
  // The vectorised conv path: each lane's 12 bf16 state values at an 8-byte boundary (base 8-byte aligned, slot stride
  // a multiple of 4 elements; lanes and heads then start at multiples of 24 bytes), each head's weights at 16 bytes
  // and each row's input at 8.
  bool w4x128 = p.head_dim == 128 && p.kernel_size == 4 && kda_prep_w4x128_enabled();
  for (int i = 0; i < 3 && w4x128; ++i) {
    w4x128 = cuda::aligned_to(in.conv_state[i].base, 8) && in.conv_state[i].slot_stride % 4 == 0 &&
             cuda::aligned_to(in.conv_weight[i], 16) && cuda::aligned_to(in.x[i], 8) && in.x_row[i] % 4 == 0;
  }
  if (w4x128) {
    kda_prep_decode_kernel<4, true><<<grid, 128, 0, stream>>>(p, in, out);
  } else if (p.head_dim <= 64) {
    kda_prep_decode_kernel<2, false><<<grid, 128, 0, stream>>>(p, in, out);
  } else if (p.head_dim <= 128) {
    kda_prep_decode_kernel<4, false><<<grid, 128, 0, stream>>>(p, in, out);
  } else {
    kda_prep_decode_kernel<8, false><<<grid, 128, 0, stream>>>(p, in, out);
  }
  BG_CUDA_CHECK_LAUNCH();
}

}  // namespace bg::ops

// CUDA linear layer: cuBLAS for dense bf16 weights, the skinny weight-streaming kernel for FP8 / MXFP4 at decode token
// counts, and dequantize-rows-to-bf16 + cuBLAS for FP8 / MXFP4 with many tokens.


#include "ops/linear/linear_cuda.h"

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "ops/linear/linear_cuda_device.cuh"

namespace bg::ops {
namespace {

using cudadev::kSkinnyRowsPerBlock;
using cudadev::kSkinnyThreads;
using cudadev::kSkinnyTokens;

// grid (ceil(n_out / 16), ceil(n_tokens / 16)): block (bx, by) computes rows [16 bx, 16 bx + 16) for tokens
// [16 by, 16 by + 16). Weights are re-read once per 16 tokens, so this is meant for n_tokens <= 16.
template <WeightFormat F>
__global__ void __launch_bounds__(kSkinnyThreads) linear_skinny_kernel(DeviceWeight w, const __nv_bfloat16* x,
                                                                      int64_t n_tokens, void* y, bool out_f32) {
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kSkinnyTokens;
  const int n_tok = static_cast<int>(n_tokens - t0 < kSkinnyTokens ? n_tokens - t0 : kSkinnyTokens);
  const DeviceWeight ws[1] = {w};
  cudadev::skinny_block<F, 1>(ws, x + t0 * w.n_in, n_tok, static_cast<int64_t>(blockIdx.x) * kSkinnyRowsPerBlock,
                              [&](int64_t row, int t, const float (&v)[1]) {
                                const int64_t idx = (t0 + t) * w.n_out + row;
                                if (out_f32) {
                                  static_cast<float*>(y)[idx] = v[0];
                                } else {
                                  static_cast<__nv_bfloat16*>(y)[idx] = __float2bfloat16(v[0]);
                                }
                              });
}

// out[r, :] = bf16(W[row0 + r, :]) for r < n_rows; one thread per 8 consecutive elements (grid-stride).
template <WeightFormat F>
__global__ void dequant_rows_kernel(DeviceWeight w, int64_t row0, int64_t n_rows, __nv_bfloat16* out) {
  const int64_t n_in = w.n_in, segs = (n_in + 7) / 8;
  const bool vec = n_in % 8 == 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_rows * segs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / segs, k0 = (i % segs) * 8;
    float v[8];
    const float s = cudadev::load_weight8<F>(w, row0 + r, k0, v);
    __nv_bfloat16* dst = out + r * n_in + k0;
    if (vec) {
      __align__(16) __nv_bfloat16 tmp[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) tmp[j] = __float2bfloat16(v[j] * s);
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(tmp);
    } else {
      for (int j = 0; j < 8 && k0 + j < n_in; ++j) dst[j] = __float2bfloat16(v[j] * s);
    }
  }
}

void check_weight(const DeviceWeight& w) {
  BG_CHECK(w.n_out > 0 && w.n_in > 0, "linear_cuda: empty weight [{}, {}]", w.n_out, w.n_in);
  BG_CHECK(w.data != nullptr, "linear_cuda: weight [{}, {}] has no data pointer", w.n_out, w.n_in);
  BG_CHECK(w.format == WeightFormat::kDense || w.scale != nullptr, "linear_cuda: {} weight [{}, {}] has no scales",
           weight_format_name(w.format), w.n_out, w.n_in);
  BG_CHECK(w.format != WeightFormat::kMxfp4 || w.n_in % kMxfp4GroupSize == 0,
           "linear_cuda: MXFP4 weight input dim {} is not a multiple of 32", w.n_in);
}

// Whether a FP8/MXFP4 weight takes the skinny kernel (true) or dequant + cuBLAS (false); dense never asks.
bool use_skinny(const LinearCudaParams& p) {
  if (p.path == LinearPath::kSkinny || (p.deterministic && p.path == LinearPath::kAuto)) return true;
  if (p.path == LinearPath::kDequantGemm) return false;
  return p.n_tokens <= kLinearSkinnyMaxTokens;
}

// C[n_tokens, n_rows] (row stride ldc elements) = x[n_tokens, n_in] A[n_rows, n_in]^T, A bf16 row-major. In cuBLAS's
// column-major terms: C^T[n_rows, n_tokens] = op(A)^T with A seen as [n_in, n_rows] (transposed) times x^T [n_in,
// n_tokens].
// beta: 0 (C is written), or 1 (C += the product, one rounding).
// x's rows are ldx elements apart (0: n_in).
void gemm_bf16(const LinearCudaContext& ctx, cudaStream_t stream, const __nv_bfloat16* a, int64_t n_rows,
               int64_t n_in, const __nv_bfloat16* x, int64_t n_tokens, void* c, bool out_f32, int64_t ldc,
               float beta = 0.0f, int64_t ldx = 0) {
  if (ldx == 0) ldx = n_in;
  BG_CHECK(ctx.cublas != nullptr, "linear_cuda: no cuBLAS handle in the context");
  BG_CHECK(ctx.cublas_workspace != nullptr && ctx.cublas_workspace_bytes > 0,
           "linear_cuda: no cuBLAS workspace in the context (pass one, e.g. kCublasWorkspaceBytes)");
  BG_CHECK(n_rows <= INT32_MAX && n_in <= INT32_MAX && n_tokens <= INT32_MAX && ldc <= INT32_MAX && ldx <= INT32_MAX &&
               ldx >= n_in,
           "linear_cuda: GEMM dims [{}, {}] x {} tokens exceed the 32-bit cuBLAS interface", n_rows, n_in, n_tokens);
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the caller's workspace is bound after it.
  BG_CUBLAS_CHECK(cublasSetStream(ctx.cublas, stream));
  BG_CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, ctx.cublas_workspace_bytes));
  const float alpha = 1.0f;
  BG_CUBLAS_CHECK(cublasGemmEx(ctx.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n_rows),
                               static_cast<int>(n_tokens), static_cast<int>(n_in), &alpha, a, CUDA_R_16BF,
                               static_cast<int>(n_in), x, CUDA_R_16BF, static_cast<int>(ldx), &beta, c,
                               out_f32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
}

// Bytes of the padded tiles a deterministic dense GEMM of fewer than kLinearFixedTokens rows needs: x then y.
size_t fixed_tile_bytes(const DeviceWeight& w, const LinearCudaParams& p) {
  const size_t out_elem = p.out_type == LinearOutType::kF32 ? sizeof(float) : sizeof(__nv_bfloat16);
  return static_cast<size_t>(kLinearFixedTokens) *
         (static_cast<size_t>(w.n_in) * sizeof(__nv_bfloat16) + static_cast<size_t>(w.n_out) * out_elem);
}

// y = x W^T with every cuBLAS call on exactly kLinearFixedTokens rows, so that cuBLAS picks one kernel per weight
// whatever the token count: full tiles in place, a last partial tile shifted back to overlap the one before (its
// overlapping rows are written twice with the same values), and fewer rows than a tile through a padded scratch.
void gemm_bf16_fixed_tiles(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                           const LinearCudaContext& ctx, cudaStream_t stream) {
  const auto* a = static_cast<const __nv_bfloat16*>(w.data);
  const bool out_f32 = p.out_type == LinearOutType::kF32;
  const size_t out_elem = out_f32 ? sizeof(float) : sizeof(__nv_bfloat16);
  const int64_t tile = kLinearFixedTokens;
  if (p.n_tokens >= tile) {
    for (int64_t r0 = 0; r0 < p.n_tokens; r0 += tile) {
      const int64_t start = std::min(r0, p.n_tokens - tile);
      gemm_bf16(ctx, stream, a, w.n_out, w.n_in, x + start * w.n_in, tile,
                static_cast<char*>(y) + static_cast<size_t>(start * w.n_out) * out_elem, out_f32, w.n_out);
    }
    return;
  }
  const size_t x_bytes = static_cast<size_t>(tile * w.n_in) * sizeof(__nv_bfloat16);
  BG_CHECK(ctx.dequant_scratch != nullptr && ctx.dequant_scratch_bytes >= fixed_tile_bytes(w, p),
           "linear_cuda: a deterministic GEMM of {} rows needs a scratch of {} bytes, got {}", p.n_tokens,
           fixed_tile_bytes(w, p), ctx.dequant_scratch_bytes);
  auto* x_tile = static_cast<__nv_bfloat16*>(ctx.dequant_scratch);
  void* y_tile = static_cast<char*>(ctx.dequant_scratch) + x_bytes;
  const size_t x_used = static_cast<size_t>(p.n_tokens * w.n_in) * sizeof(__nv_bfloat16);
  BG_CUDA_CHECK(cudaMemcpyAsync(x_tile, x, x_used, cudaMemcpyDeviceToDevice, stream));
  BG_CUDA_CHECK(cudaMemsetAsync(reinterpret_cast<char*>(x_tile) + x_used, 0, x_bytes - x_used, stream));
  gemm_bf16(ctx, stream, a, w.n_out, w.n_in, x_tile, tile, y_tile, out_f32, w.n_out);
  BG_CUDA_CHECK(cudaMemcpyAsync(y, y_tile, static_cast<size_t>(p.n_tokens * w.n_out) * out_elem,
                                cudaMemcpyDeviceToDevice, stream));
}

template <WeightFormat F>
void launch_skinny(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                   cudaStream_t stream) {
  const int64_t n_row_blocks = (w.n_out + kSkinnyRowsPerBlock - 1) / kSkinnyRowsPerBlock;
  const int64_t n_tok_blocks = (p.n_tokens + kSkinnyTokens - 1) / kSkinnyTokens;
  BG_CHECK(n_row_blocks <= INT32_MAX && n_tok_blocks <= 65535, "linear_cuda: grid {} x {} too large", n_row_blocks,
           n_tok_blocks);
  const dim3 grid(static_cast<unsigned>(n_row_blocks), static_cast<unsigned>(n_tok_blocks));
  linear_skinny_kernel<F><<<grid, kSkinnyThreads, 0, stream>>>(w, x, p.n_tokens, y,
                                                                 p.out_type == LinearOutType::kF32);
  BG_CUDA_CHECK_LAUNCH();
}

// Rows of W per dequant chunk that the scratch allows: all of them when they fit, else a multiple of 128.
int64_t dequant_chunk_rows(const DeviceWeight& w, size_t scratch_bytes) {
  const int64_t fit = static_cast<int64_t>(scratch_bytes / (static_cast<size_t>(w.n_in) * sizeof(__nv_bfloat16)));
  if (fit >= w.n_out) return w.n_out;
  return std::min(fit, kLinearDequantChunkRows) / 128 * 128;
}

template <WeightFormat F>
void launch_dequant_gemm(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                         const LinearCudaContext& ctx, cudaStream_t stream) {
  const int64_t chunk = dequant_chunk_rows(w, ctx.dequant_scratch_bytes);
  BG_CHECK(ctx.dequant_scratch != nullptr && chunk > 0,
           "linear_cuda: dequant path for {} weight [{}, {}] needs a scratch of at least {} bytes, got {}",
           weight_format_name(w.format), w.n_out, w.n_in, linear_dequant_scratch_min_bytes(w),
           ctx.dequant_scratch_bytes);
  auto* scratch = static_cast<__nv_bfloat16*>(ctx.dequant_scratch);
  const bool out_f32 = p.out_type == LinearOutType::kF32;
  const size_t out_elem = out_f32 ? sizeof(float) : sizeof(__nv_bfloat16);
  for (int64_t r0 = 0; r0 < w.n_out; r0 += chunk) {
    const int64_t rows = std::min(chunk, w.n_out - r0);
    const int64_t work = rows * ((w.n_in + 7) / 8);
    const int blocks = static_cast<int>(std::min<int64_t>((work + 255) / 256, 132 * 16));
    dequant_rows_kernel<F><<<blocks, 256, 0, stream>>>(w, r0, rows, scratch);
    BG_CUDA_CHECK_LAUNCH();
    gemm_bf16(ctx, stream, scratch, rows, w.n_in, x, p.n_tokens, static_cast<char*>(y) + r0 * out_elem, out_f32,
              w.n_out);
  }
}

template <WeightFormat F>
void launch_quantized(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                      const LinearCudaContext& ctx, cudaStream_t stream) {
  if (use_skinny(p)) {
    launch_skinny<F>(p, w, x, y, stream);
  } else {
    launch_dequant_gemm<F>(p, w, x, y, ctx, stream);
  }
}

}  // namespace

size_t linear_dequant_scratch_min_bytes(const DeviceWeight& w) {
  return static_cast<size_t>(std::min<int64_t>(w.n_out, 128) * w.n_in) * sizeof(__nv_bfloat16);
}

size_t linear_dequant_scratch_bytes(const DeviceWeight& w, const LinearCudaParams& p) {
  if (w.format == WeightFormat::kDense) {
    return p.deterministic && p.n_tokens > 0 && p.n_tokens < kLinearFixedTokens ? fixed_tile_bytes(w, p) : 0;
  }
  if (use_skinny(p)) return 0;
  return static_cast<size_t>(std::min(w.n_out, kLinearDequantChunkRows) * w.n_in) * sizeof(__nv_bfloat16);
}

void linear_cuda(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                 const LinearCudaContext& ctx, cudaStream_t stream) {
  check_weight(w);
  BG_CHECK(p.n_tokens >= 0, "linear_cuda: n_tokens {} is negative", p.n_tokens);
  if (p.n_tokens == 0) return;
  BG_CHECK(x != nullptr && y != nullptr, "linear_cuda: null x or y with {} tokens", p.n_tokens);
  BG_CHECK(!p.accumulate || (w.format == WeightFormat::kDense && !p.deterministic),
           "linear_cuda: accumulating into y takes dense weights without --deterministic ({} weight, deterministic {})",
           weight_format_name(w.format), p.deterministic);
  BG_CHECK(w.format == WeightFormat::kDense || (p.path != LinearPath::kCublas && p.path != LinearPath::kDenseDecode),
           "linear_cuda: path {} is for dense weights, not {}", static_cast<int>(p.path), weight_format_name(w.format));
  const bool strided_x = p.x_ld != 0 && p.x_ld != w.n_in;
  BG_CHECK(!strided_x || (w.format == WeightFormat::kDense && !p.deterministic && p.path != LinearPath::kDenseDecode &&
                          p.x_ld > w.n_in),
           "linear_cuda: x rows {} elements apart take the dense cuBLAS path only (weight {}, n_in {})", p.x_ld,
           weight_format_name(w.format), w.n_in);
  switch (w.format) {
    case WeightFormat::kDense:
      BG_CHECK(p.path == LinearPath::kAuto || p.path == LinearPath::kCublas || p.path == LinearPath::kDenseDecode,
               "linear_cuda: dense weights take cuBLAS or the decode GEMM; path {} was requested",
               static_cast<int>(p.path));
      if (p.path == LinearPath::kDenseDecode) {
        BG_CHECK(ctx.dense_decode != nullptr, "linear_cuda: the decode GEMM was requested without its workspace");
        BG_CHECK(!p.deterministic, "linear_cuda: the decode GEMM is not the --deterministic path");
        dense_decode_cuda(p, w, x, y, *ctx.dense_decode, stream);
        return;
      }
      if (p.path == LinearPath::kAuto && !strided_x && dense_decode_applies(p, w, x, ctx)) {
        dense_decode_cuda(p, w, x, y, *ctx.dense_decode, stream);
        return;
      }
      if (p.deterministic) {
        gemm_bf16_fixed_tiles(p, w, x, y, ctx, stream);
        return;
      }
      gemm_bf16(ctx, stream, static_cast<const __nv_bfloat16*>(w.data), w.n_out, w.n_in, x, p.n_tokens, y,
                p.out_type == LinearOutType::kF32, w.n_out, p.accumulate ? 1.0f : 0.0f, p.x_ld);
      return;
    case WeightFormat::kFp8Block: return launch_quantized<WeightFormat::kFp8Block>(p, w, x, y, ctx, stream);
    case WeightFormat::kMxfp4: return launch_quantized<WeightFormat::kMxfp4>(p, w, x, y, ctx, stream);
  }
  fail("linear_cuda: unknown weight format {}", static_cast<int>(w.format));
}

}  // namespace bg::ops

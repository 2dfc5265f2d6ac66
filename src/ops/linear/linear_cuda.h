// CUDA linear layer y[n, out] = x[n, in] W^T: the device weight descriptor (dense bf16, FP8 E4M3 + 128x128 block
// scales, MXFP4 codes + E8M0 scales), its upload from a host QuantWeight, and the launcher. Included only by CUDA code,
// the CUDA backend and GPU tests.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "backend/cuda/device_buffer.h"
#include "formats/quant.h"
#include "ops/elementwise/elementwise.h"

namespace bg::ops {

// A [n_out, n_in] linear weight in device memory (POD: copied into kernel parameters and into device arrays of
// per-expert descriptors). The pointers are owned by whoever uploaded the weight.
struct DeviceWeight {
  WeightFormat format = WeightFormat::kDense;
  int64_t n_out = 0;
  int64_t n_in = 0;
  // kDense: bf16 [out, in]; kFp8Block: E4M3 bytes [out, in]; kMxfp4: bytes [out, in/2] (low nibble = even element).
  const void* data = nullptr;
  // kFp8Block: fp32 [ceil(out/128), ceil(in/128)] (multiply: "scale_inv" in checkpoint naming); kMxfp4: E8M0 bytes
  // [out, in/32]; kDense: null.
  const void* scale = nullptr;
};

// An uploaded weight: the descriptor plus what it points into (keep them alive together): its own buffers
// (upload_weight), or a share of the one allocation of its batch (cuda::WeightUploader).
struct DeviceWeightStorage {
  DeviceWeight desc;
  cuda::DeviceBuffer data;
  cuda::DeviceBuffer scale;
  std::shared_ptr<cuda::DeviceBuffer> arena;
};

// Bytes the device copy of each part of `w` takes: {data, scale} (dense weights become bf16).
std::pair<size_t, size_t> device_weight_bytes(const QuantWeight& w);

// Copies a host QuantWeight into new device buffers (synchronous; load time only). Dense F32/F16 weights are rounded
// to bf16 (round to nearest even) on the host first; BF16, FP8 and MXFP4 bytes are copied as stored.
DeviceWeightStorage upload_weight(const QuantWeight& w);

enum class LinearOutType : uint8_t { kBf16, kF32 };

// Which kernel path runs. kAuto picks by format and n_tokens (below); the others exist for tests and benchmarks and
// are errors where they do not apply (an explicit request is never silently replaced).
enum class LinearPath : uint8_t {
  kAuto,
  kSkinny,        // FP8/MXFP4 only: weight-streaming kernel, each weight byte read once per 16 tokens
  kDequantGemm,   // FP8/MXFP4 only: dequantize rows to bf16 scratch, then cuBLAS
  kCublas,        // dense only: cuBLAS
  kDenseDecode,   // dense only: the decode GEMM (linear_decode_cuda.cu); needs LinearCudaContext::dense_decode
};

// kAuto uses the skinny kernel for FP8/MXFP4 when n_tokens <= this (decode), dequantize + cuBLAS above it; dense
// weights take the decode GEMM up to kDenseDecodeMaxTokens tokens where the context has its workspace (the backend
// passes one only with BG_LINEAR_DECODE=1) and the shape fits it (dense_decode_applies), cuBLAS otherwise.
inline constexpr int64_t kLinearSkinnyMaxTokens = 16;

struct LinearCudaParams {
  int64_t n_tokens = 0;                       // rows of x and y; 0 launches nothing
  LinearOutType out_type = LinearOutType::kBf16;
  LinearPath path = LinearPath::kAuto;
  // Batch invariance (--deterministic): a row's result must not depend on n_tokens. cuBLAS picks its kernel by the
  // GEMM's shape, so every dense GEMM then runs on exactly kLinearFixedTokens rows (tiles of x; a last partial tile
  // overlaps the one before it, and fewer rows than a tile are padded through the scratch), and FP8/MXFP4 weights
  // always take the skinny kernel (its per-token arithmetic never depends on the other tokens).
  bool deterministic = false;
  // y += x W^T instead of y = x W^T: the fp32 sum of the product and y's value rounded once (cuBLAS's beta = 1). Dense
  // weights only, and not with `deterministic` (whose overlapping tiles write some rows twice): refused otherwise.
  bool accumulate = false;
  // Elements from one row of x to the next (0: n_in): a strided view of a wider buffer (a fused group's part, the
  // backend's linear_group). Taken by the non-deterministic dense cuBLAS path only; refused elsewhere.
  int64_t x_ld = 0;
};

// The token count of every dense GEMM under LinearCudaParams::deterministic.
inline constexpr int64_t kLinearFixedTokens = 64;

// Workspace of the dense decode GEMM: fp32 partial sums of its k-splits, and one arrival counter per row tile, zero
// between launches (the last arrival resets its counter, so graph replays start from zero). Caller-owned, one per
// stream (two launches in flight at once must not share it).
struct DenseDecodeWorkspace {
  float* partials = nullptr;
  size_t partial_bytes = 0;
  int32_t* counters = nullptr;
  int64_t n_counters = 0;
};
inline constexpr size_t kDenseDecodePartialBytes = size_t{16} << 20;
inline constexpr int64_t kDenseDecodeCounters = 8192;
// Bytes of the one device buffer a workspace is carved from; the carving; the counters zeroed (stream-ordered: once,
// before the first launch).
size_t dense_decode_workspace_bytes();
DenseDecodeWorkspace dense_decode_workspace(void* buffer);
void dense_decode_workspace_init(const DenseDecodeWorkspace& ws, cudaStream_t stream);
// BG_LINEAR_DECODE: 1 gives the CUDA backend (and the bench's cases) a workspace, so kAuto takes the decode GEMM; 0
// (the default: cuBLAS measured faster, docs/PERF.md "Dense decode GEMM") keeps every dense GEMM on cuBLAS.
// BG_LINEAR_DECODE_SPLITS=n (tuning): n k-splits wherever they fit instead of the plan's choice. Read once.
bool dense_decode_enabled();
int dense_decode_forced_splits();

// Caller-owned resources. The cuBLAS handle belongs to the backend; the launcher only binds it to `stream` and to
// the workspace below (cublasSetStream / cublasSetWorkspace) before each GEMM, so a captured graph never allocates.
struct LinearCudaContext {
  cublasHandle_t cublas = nullptr;   // required by the dense and dequant paths
  void* cublas_workspace = nullptr;  // >= kCublasWorkspaceBytes recommended (cuBLAS guidance for Hopper)
  size_t cublas_workspace_bytes = 0;
  void* dequant_scratch = nullptr;   // bf16 rows for the dequant path, or the padded tile of a deterministic dense GEMM
                                     // of fewer than kLinearFixedTokens rows; see linear_dequant_scratch_bytes
  size_t dequant_scratch_bytes = 0;
  const DenseDecodeWorkspace* dense_decode = nullptr;  // null: dense GEMMs on cuBLAS
};

inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Rows of W dequantized per cuBLAS call on the dequant path: up to this many (a multiple of 128), fewer if the
// scratch is smaller. The scratch must hold at least min(n_out, 128) rows.
inline constexpr int64_t kLinearDequantChunkRows = 4096;

// Scratch bytes the dequant path wants for this weight and token count: 0 where it does not run (dense weights,
// skinny path), else min(n_out, kLinearDequantChunkRows) rows of n_in bf16. A smaller scratch of at least
// linear_dequant_scratch_min_bytes also works, in more chunks. A deterministic dense GEMM of fewer than
// kLinearFixedTokens rows wants one padded tile of x and of y instead (exactly that size).
size_t linear_dequant_scratch_bytes(const DeviceWeight& w, const LinearCudaParams& p);
size_t linear_dequant_scratch_min_bytes(const DeviceWeight& w);

// y[n_tokens, w.n_out] = x[n_tokens, w.n_in] W^T with fp32 accumulation; y is bf16 or fp32 per p.out_type and must
// not alias x. x rows are contiguous (stride n_in). No host synchronisation, no allocation.
//   dense: cublasGemmEx (bf16 x bf16 -> bf16/fp32, fp32 compute); the decode GEMM instead at 1..64 tokens when the
//   context carries its workspace (dense_decode_applies; the backend only with BG_LINEAR_DECODE=1).
//   FP8 / MXFP4, n_tokens <= 16: skinny weight-streaming kernel (weights decoded in registers, scales applied in fp32).
//   FP8 / MXFP4, more tokens: rows dequantized to bf16 (code * scale rounded to bf16) into ctx.dequant_scratch, then
//   cublasGemmEx per chunk of rows. The extra pass costs ~5 bytes per weight against 2*n_tokens*n_in FLOPs per row,
//   which tensor cores amortize for n_tokens > 16; a fused W8A16/W4A16 tensor-core kernel can replace it later.
void linear_cuda(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                 const LinearCudaContext& ctx, cudaStream_t stream);

// Whether kAuto sends this dense GEMM to the decode kernel: 1..kDenseDecodeMaxTokens tokens, n_in a multiple of 64,
// x and the weight 16-byte aligned, not deterministic, a workspace in the context.
bool dense_decode_applies(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x,
                          const LinearCudaContext& ctx);
// The decode GEMM itself (kDenseDecode); refuses what dense_decode_applies would refuse (deterministic aside).
void dense_decode_cuda(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x, void* y,
                       const DenseDecodeWorkspace& ws, cudaStream_t stream);
// The same with y split into column parts as it is written (a fused group's outputs, no split_columns pass): output
// column c of token t goes to parts[i].dst[t * parts[i].cols + c - parts[i].col0]. bf16, not accumulating; the parts
// tile [0, n_out) in order, at most kMaxColumnSlices.
void dense_decode_parts_cuda(const LinearCudaParams& p, const DeviceWeight& w, const __nv_bfloat16* x,
                             std::span<const ColumnSlice> parts, const DenseDecodeWorkspace& ws, cudaStream_t stream);

}  // namespace bg::ops

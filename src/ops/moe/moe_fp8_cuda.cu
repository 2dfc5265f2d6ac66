// The FP8 prefill path of the expert FFN (moe_fp8_cuda.h): the conversion of W4A16-layout experts to E4M3 with
// power-of-two scales per 128 inputs, the row quantization (x, and h inside the GLU kernel), and the cuBLASLt
// block-scaled GEMMs per expert.
//
// Per call: quantize x (one launch over all rows); per group of experts: convert (W4A16 layout only), gate|up GEMMs,
// GLU + quantize h, down GEMMs. In cuBLASLt's column-major terms every GEMM is D^T[m, n] = A^T (A [m, k] row-major
// read transposed) times B^T, as linear_cuda's bf16 GEMM: "TN", the only layout Hopper's FP8 kernels take.

#include "ops/moe/moe_fp8_cuda.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <functional>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "ops/linear/linear_cuda_device.cuh"
#include "ops/moe/fp8_block_device.cuh"
#include "ops/moe/moe_glu_device.cuh"
#include "ops/moe/moe_grouped_device.cuh"
#include "ops/moe_w4a16/moe_w4a16_layout.h"

namespace bg::ops {
namespace {

using bf16 = __nv_bfloat16;

using grouped::GroupSlots;
using grouped::grid_for;
using grouped::kThreads;
using grouped::w4_scale;
using grouped::w4_weight;

// 2^e exactly: the bits for a normal exponent, ldexpf past them.
__device__ __forceinline__ float pow2f(int e) {
  return e >= -126 && e <= 127 ? __int_as_float((127 + e) << 23) : ldexpf(1.0f, e);
}

// The max over the `width` lanes of each aligned group (width a power of two <= 32; every lane calls it).
__device__ __forceinline__ float lanes_max(float v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The touched expert holding permuted row `row`: the last i with row_begin[i] <= row (row_begin ascending, n entries
// then the total).
__device__ __forceinline__ int expert_of_row(const int64_t* row_begin, int n, int64_t row) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (row_begin[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One warp quantizes one 128-input block of one row: lane l holds inputs 4 l .. 4 l + 3 (`v`, zeros past the row's
// end), writes their codes (`valid`) and lane 0 the block's scale at its expert's place. `table`: the experts' first
// rows (n_experts + 1), then their scale_row0 (moe_fp8.h).
__device__ __forceinline__ void quantize_block(const float (&v)[4], bool valid, int64_t row, int64_t b, int64_t width,
                                               const int64_t* table, int n_experts, uint8_t* q, float* scales) {
  const float scale = fp8_block_scale_warp(v);
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (valid) *reinterpret_cast<uint32_t*>(q + row * width + b * kFp8BlockInputs + 4 * lane) = fp8_codes4(v, scale);
  if (lane == 0) {
    const int e = expert_of_row(table, n_experts, row);
    const int64_t rb = table[e], rows = table[e + 1] - rb;
    scales[fp8_row_scale_index(width, table[n_experts + 1 + e], rows, row - rb, b)] = scale;
  }
}

// Warp w of the grid quantizes the (row, block) pairs w, w + warps, ... of rows [0, n_rows): load(r, c, v) fills the
// lane's four inputs c .. c + 3 of row r (only where c < width); the row's permuted index is row0 + r.
template <typename Load>
__device__ __forceinline__ void quantize_row_blocks(int64_t n_rows, int64_t width, int64_t row0, const Load& load,
                                                    const int64_t* table, int n_experts, uint8_t* q, float* scales) {
  const int64_t blocks = fp8_blocks(width), n = n_rows * blocks;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int lane = static_cast<int>(threadIdx.x & 31);
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; w < n; w += warps) {
    const int64_t r = w / blocks, b = w % blocks, c = b * kFp8BlockInputs + 4 * lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bool valid = c < width;
    if (valid) load(r, c, v);
    quantize_block(v, valid, row0 + r, b, width, table, n_experts, q, scales);
  }
}

// x rows [n_rows, width] (bf16) -> E4M3 + scales; width % 4 == 0.
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(const bf16* x, int64_t n_rows, int64_t width,
                                                                 const int64_t* table, int n_experts, uint8_t* q,
                                                                 float* scales) {
  const auto load = [&](int64_t r, int64_t c, float (&v)[4]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(x + r * width + c);
    const float2 a = cudadev::bf16x2_to_float2(raw.x), b = cudadev::bf16x2_to_float2(raw.y);
    v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
  };
  quantize_row_blocks(n_rows, width, 0, load, table, n_experts, q, scales);
}

// h = GLU(gate, up) of a group's rows (gu: bf16 [n_rows, 2 inter], the group's first permuted row `row0`), computed in
// fp32 and quantized straight to E4M3 (no bf16 h); inter % 4 == 0.
__global__ void __launch_bounds__(kThreads) glu_quantize_kernel(const bf16* gu, int64_t n_rows, int64_t row0,
                                                                int64_t inter, MoeGluParams act, const int64_t* table,
                                                                int n_experts, uint8_t* q, float* scales) {
  const auto load = [&](int64_t r, int64_t c, float (&v)[4]) {
    const uint2 g = *reinterpret_cast<const uint2*>(gu + r * 2 * inter + c);
    const uint2 u = *reinterpret_cast<const uint2*>(gu + r * 2 * inter + inter + c);
    const float2 g0 = cudadev::bf16x2_to_float2(g.x), g1 = cudadev::bf16x2_to_float2(g.y);
    const float2 u0 = cudadev::bf16x2_to_float2(u.x), u1 = cudadev::bf16x2_to_float2(u.y);
    v[0] = moe_glu(g0.x, u0.x, act), v[1] = moe_glu(g0.y, u0.y, act);
    v[2] = moe_glu(g1.x, u1.x, act), v[3] = moe_glu(g1.y, u1.y, act);
  };
  quantize_row_blocks(n_rows, inter, row0, load, table, n_experts, q, scales);
}

// Two lanes of a decoded register (elements k, k + 1 of a row) -> their two E4M3 codes (k in the low byte) under
// the block exponent s, weight by weight with the exact arithmetic (out of line: the rare case).
__device__ __noinline__ uint32_t convert_pair_exact(uint32_t r, int s_prime, float shift, int s) {
  const float lo = ldexpf(w4_weight(r & 0xffffu, w4_scale(static_cast<uint32_t>(s_prime)), shift), -s);
  const float hi = ldexpf(w4_weight(r >> 16, w4_scale(static_cast<uint32_t>(s_prime)), shift), -s);
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// The same where fp8_convert_fast holds: (lane x 2^126) x 2^e, c = 2^e.
__device__ __forceinline__ uint32_t convert_pair(uint32_t r, bool fast, float c, int s_prime, float shift, int s) {
  if (!fast) return convert_pair_exact(r, s_prime, shift, s);
  constexpr float kLaneUnit = 0x1p126f;  // lane x 2^126 = the E2M1 value exactly
  const float lo = __uint_as_float(r << 16) * kLaneUnit * c;
  const float hi = __uint_as_float(r & 0xffff0000u) * kLaneUnit * c;
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// W4A16-layout experts -> E4M3 [n_out, n_in] + power-of-two VEC128 scales [blocks][n_out] (moe_fp8_expert_layout).
// Thread i of a matrix converts one lane's 16 code bytes of one tile in each of the two 64-input stages of a
// 128-input block (rows g and g + 8 of the m16 tile, inputs 16 t .. 16 t + 15 of each stage), to the codes of the
// weights' exact values (as the dequantize-once path decodes them). Both stages' loads are issued first; the four
// lanes t = 0..3 of a row hold its whole block, and its amax comes from the largest code magnitude of each of its
// (stage, row) groups (the value is monotone in the magnitude bits), so the weights are decoded twice (max, then
// codes) instead of being held. grid.y: the group's experts x 2 (gate/up, down).
__global__ void __launch_bounds__(kThreads, 4) convert_w4a16_kernel(const void* const* blocks, GroupSlots g,
                                                                    MoeW4a16LayoutInfo info, MoeFp8ExpertLayout lay,
                                                                    uint8_t* dst, int32_t* error_flags) {
  const int j = static_cast<int>(blockIdx.y) / 2;
  const bool gate_up = blockIdx.y % 2 == 0;
  const auto* block = static_cast<const uint8_t*>(blocks[g.slot[j]]);
  if (block == nullptr) {
    if (threadIdx.x == 0 && blockIdx.x == 0) atomicOr(error_flags, kMoeErrorBadDescriptor);
    return;
  }
  const MoeW4a16MatrixInfo& m = gate_up ? info.gate_up : info.down;
  const int64_t I = info.inter, scale_rows = gate_up ? 2 * I : info.hidden;
  uint8_t* base = dst + static_cast<size_t>(j) * lay.bytes;
  uint8_t* w8 = base + (gate_up ? lay.gate_up : lay.down);
  auto* sc = reinterpret_cast<float*>(base + (gate_up ? lay.gate_up_scale : lay.down_scale));
  const int shift_i = m.scale_shift;
  const float shift = exp2f(static_cast<float>(shift_i));
  constexpr int kLaneTiles = w4::kWarps * w4::kMTiles * 32;  // per stage block
  const int n_pairs = (m.n_kstages + 1) / 2;
  const int64_t n = static_cast<int64_t>(m.n_items) * n_pairs * kLaneTiles;  // a multiple of 32: whole warps
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t pair_index = i / kLaneTiles;
    const int in_stage = static_cast<int>(i % kLaneTiles);
    const int lane = in_stage & 31, mt = (in_stage >> 5) % w4::kMTiles, warp = in_stage >> 5 >> 2;
    const int item = static_cast<int>(pair_index / n_pairs), pair = static_cast<int>(pair_index % n_pairs);
    const int g8 = lane >> 2, t = lane & 3;
    uint4 q[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    uint32_t sp[2] = {0, 0};  // the stored scale bytes s' of rows g (bits 0..7) and g + 8 (bits 8..15)
    bool stage_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int kstage = 2 * pair + h;
      stage_ok[h] = kstage < m.n_kstages && static_cast<int64_t>(kstage) * w4::kKStage + 16 * t < m.n_in;
      if (!stage_ok[h]) continue;
      const int64_t stage = static_cast<int64_t>(item) * m.n_kstages + kstage;
      const uint8_t* sb = block + m.offset_bytes + stage * w4::kStageBytes;
      q[h] = __ldg(reinterpret_cast<const uint4*>(sb + w4::code_offset(warp, mt, lane)));
      sp[h] = __ldg(reinterpret_cast<const uint16_t*>(sb + w4::scale_offset(warp, g8, t >> 1, mt, 0)));
    }
    // Row half rh's elements are registers rh (inputs 4 ks, 4 ks + 1) and rh + 2 (4 ks + 2, 4 ks + 3) of word ks.
    float amax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t words[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
      constexpr uint32_t kNoSign = 0x7fff7fffu;  // unsigned order of the rest = order of the magnitudes
      uint32_t mag[2] = {0, 0};                   // per row half: the largest magnitude bits in each 16-bit half
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint32_t r[4];
        w4::decode_word(words[ks], r);
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) mag[rh] = __vmaxu2(mag[rh], __vmaxu2(r[rh] & kNoSign, r[rh + 2] & kNoSign));
      }
#pragma unroll
      for (int rh = 0; rh < 2; ++rh) {
        const uint32_t top = max(mag[rh] & 0xffffu, mag[rh] >> 16);
        if (stage_ok[h]) amax[rh] = fmaxf(amax[rh], w4_weight(top, w4_scale((sp[h] >> (8 * rh)) & 0xffu), shift));
      }
    }
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int r16 = g8 + 8 * rh;
      const int64_t row = gate_up ? w4::gate_up_column(item, warp, mt, r16) : w4::down_row(item, warp, mt, r16);
      const int s = fp8_weight_scale_exponent(lanes_max(amax[rh], 4));  // the row's four lanes t = lane bits 0, 1
      if (row >= m.n_out) continue;
      const int64_t out_row = row + (gate_up && w4::gate_up_is_up(mt) ? I : 0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!stage_ok[h]) continue;
        const int s_prime = static_cast<int>((sp[h] >> (8 * rh)) & 0xffu);
        const bool fast = fp8_convert_fast(s_prime, shift_i);
        const float c = pow2f(fp8_convert_exponent(s_prime, shift_i, s));
        const uint32_t words[4] = {q[h].x, q[h].y, q[h].z, q[h].w};
        uint32_t packed[4];
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          uint32_t r[4];
          w4::decode_word(words[ks], r);
          packed[ks] = convert_pair(r[rh], fast, c, s_prime, shift, s) |
                       convert_pair(r[rh + 2], fast, c, s_prime, shift, s) << 16;
        }
        const int64_t k0 = static_cast<int64_t>(2 * pair + h) * w4::kKStage + 16 * t;
        *reinterpret_cast<uint4*>(w8 + out_row * m.n_in + k0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
      if (t == 0) sc[static_cast<int64_t>(pair) * scale_rows + out_row] = pow2f(s);
    }
  }
}

// RAII for the per-call cuBLASLt descriptors.
struct LtDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  ~LtDesc() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

const char* mode_name(Fp8ScaleMode m) { return m == Fp8ScaleMode::kVec128 ? "1x128" : "128x128"; }

}  // namespace

size_t MoeFp8Gemm::KeyHash::operator()(const Key& k) const {
  size_t h = std::hash<int>()(k.m);
  for (const int v : {k.n, k.k, k.ldd, static_cast<int>(k.mode)}) h = h * 1000003u ^ std::hash<int>()(v);
  return h;
}

MoeFp8Gemm::MoeFp8Gemm() : autotune_(env_switch("BG_MOE_FP8_AUTOTUNE", true)) {
  BG_CUBLAS_CHECK(cublasLtCreate(&lt_));
}

MoeFp8Gemm::~MoeFp8Gemm() {
  if (lt_ != nullptr) cublasLtDestroy(lt_);
}

namespace {

// The n an algorithm is asked for: the next power of two (at least 16), so that the experts' ragged row counts share
// a few heuristic calls (each costs host time; a prefill layer runs 2-3 GEMMs per touched expert).
int n_bucket(int n) {
  int b = 16;
  while (b < n && b < (1 << 30)) b *= 2;
  return b;
}

}  // namespace

cublasLtMatmulAlgo_t MoeFp8Gemm::find_algorithm(const Problem& p, int n, cublasLtMatmulDesc_t desc,
                                                size_t workspace_bytes, const Matmul& matmul, cudaStream_t stream) {
  const auto u = [](int v) { return static_cast<uint64_t>(v); };
  LtDesc l;  // layouts for n (the descriptor is the caller's)
  BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l.a, CUDA_R_8F_E4M3, u(p.k), u(p.m), p.k));
  BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l.b, CUDA_R_8F_E4M3, u(p.k), u(n), p.k));
  BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l.d, CUDA_R_16BF, u(p.m), u(n), p.ldd));
  cublasLtMatmulPreference_t pref = nullptr;
  BG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const int wanted = autotune_ ? kCandidates : 1;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &workspace_bytes, sizeof workspace_bytes);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(lt_, desc, l.a, l.b, l.d, l.d, pref, wanted, results, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  ++heuristic_calls_;
  BG_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
           "moe fp8 gemm: cuBLASLt ({}) has no block-scaled E4M3 kernel for [{} x {}] x [{} x {}]^T (A scales {}, "
           "B scales 1x128): {}; needs Hopper and cuBLAS >= 12.9",
           cublasLtGetVersion(), n, p.k, p.m, p.k, mode_name(p.a_mode), cublasGetStatusString(st));
  // More than one candidate: each runs the problem at hand (beta = 0, so the output is only rewritten) once to warm
  // up and kTimedRuns times between events; the fastest is kept. Synchronises the stream (never under capture:
  // the FP8 path does not run in a captured graph).
  int best = 0;
  float best_ms = 0.0f;
  if (found > 1) {
    cudaEvent_t start = nullptr, stop = nullptr;
    BG_CUDA_CHECK(cudaEventCreate(&start));
    BG_CUDA_CHECK(cudaEventCreate(&stop));
    best = -1;
    for (int i = 0; i < found; ++i) {
      if (matmul(results[i].algo) != CUBLAS_STATUS_SUCCESS) continue;  // refused for this n
      BG_CUDA_CHECK(cudaEventRecord(start, stream));
      for (int r = 0; r < kTimedRuns; ++r) BG_CUBLAS_CHECK(matmul(results[i].algo));
      BG_CUDA_CHECK(cudaEventRecord(stop, stream));
      BG_CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0.0f;
      BG_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      if (best < 0 || ms < best_ms) {
        best = i;
        best_ms = ms;
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (best < 0) best = 0;
  }
  if (std::has_single_bit(static_cast<uint64_t>(heuristic_calls_))) {  // 1, 2, 4, ...: how often shapes are new
    log::info("moe fp8 gemm: {} cuBLASLt algorithm searches so far (this one [{} x {}] x [{} x {}]^T, {} A scales: "
              "candidate {} of {}, {:.3f} ms)", heuristic_calls_, n, p.k, p.m, p.k, mode_name(p.a_mode), best + 1,
              found, best_ms / kTimedRuns);
  }
  return results[best].algo;
}

void MoeFp8Gemm::run(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.n == 0) return;
  BG_CHECK(p.m > 0 && p.n > 0 && p.k > 0 && p.k % 16 == 0 && p.ldd >= p.m,
           "moe fp8 gemm: [{} x {}] x [{} x {}]^T with ldd {} (k a multiple of 16)", p.n, p.k, p.m, p.k, p.ldd);
  LtDesc l;
  BG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&l.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  BG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(l.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
  BG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(l.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  const cublasLtMatmulMatrixScale_t a_mode = p.a_mode == Fp8ScaleMode::kVec128
                                                 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                                 : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  BG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(l.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode));
  BG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(l.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode));
  BG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(l.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.a_scale, sizeof p.a_scale));
  BG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(l.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.b_scale, sizeof p.b_scale));
  const auto u = [](int v) { return static_cast<uint64_t>(v); };
  BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l.a, CUDA_R_8F_E4M3, u(p.k), u(p.m), p.k));
  BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l.b, CUDA_R_8F_E4M3, u(p.k), u(p.n), p.k));
  BG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l.d, CUDA_R_16BF, u(p.m), u(p.n), p.ldd));
  const float alpha = 1.0f, beta = 0.0f;
  const Matmul matmul = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(lt_, l.desc, &alpha, p.a, l.a, p.b, l.b, &beta, p.d, l.d, p.d, l.d, &algo, workspace,
                          workspace_bytes, stream);
  };
  // The bucket's algorithm first; where cuBLASLt refuses it for this n, the one asked for n itself (kept too).
  const Key bucket{p.m, n_bucket(p.n), p.k, p.ldd, p.a_mode};
  auto it = algos_.find(bucket);
  if (it == algos_.end()) {
    it = algos_.emplace(bucket, find_algorithm(p, bucket.n, l.desc, workspace_bytes, matmul, stream)).first;
  }
  if (matmul(it->second) == CUBLAS_STATUS_SUCCESS) return;
  const Key exact{p.m, -p.n, p.k, p.ldd, p.a_mode};  // negative n: an exact entry, never a bucket's
  auto ex = algos_.find(exact);
  if (ex == algos_.end()) {
    ex = algos_.emplace(exact, find_algorithm(p, p.n, l.desc, workspace_bytes, matmul, stream)).first;
  }
  BG_CUBLAS_CHECK(matmul(ex->second));
}

bool moe_fp8_supported(const MoeCudaParams& p, bool packed, bool fp8_stages) {
  if (p.hidden % 16 != 0 || p.inter % 16 != 0 || p.hidden > INT32_MAX / 2 || p.inter > INT32_MAX / 2) return false;
  if (packed) return p.expert_format == WeightFormat::kMxfp4;
  return fp8_stages && p.expert_format == WeightFormat::kFp8Block;
}

void moe_fp8_convert_w4a16_cuda(const MoeGroupedPlan& plan, const MoeGroupedGroup& g, const MoeW4a16Weights& w,
                                void* scratch, int32_t* error_flags, cudaStream_t stream) {
  BG_CHECK(w.info.version == kMoeW4a16LayoutVersion && w.info.hidden == plan.hidden && w.info.inter == plan.inter &&
               w.blocks != nullptr,
           "moe fp8: W4A16 layout v{} [{} -> {}] for a plan [{} -> {}]", w.info.version, w.info.hidden,
           w.info.inter, plan.hidden, plan.inter);
  BG_CHECK(g.n_experts >= 1 && g.n_experts <= kMoeGroupedMaxGroupExperts, "moe fp8: a group of {} experts",
           g.n_experts);
  const GroupSlots slots = grouped::group_slots(plan, g);
  const MoeFp8ExpertLayout lay = moe_fp8_expert_layout(plan.hidden, plan.inter);
  const int x = grid_for(plan.hidden * plan.inter / 32, std::max(1, 2 * 132 * 8 / (2 * g.n_experts)));
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(2 * g.n_experts));
  convert_w4a16_kernel<<<grid, kThreads, 0, stream>>>(w.blocks, slots, w.info, lay, static_cast<uint8_t*>(scratch),
                                                       error_flags);
  BG_CUDA_CHECK_LAUNCH();
}

void moe_fp8_write_table(const MoeGroupedPlan& plan, void* call_buffer, size_t call_buffer_bytes,
                         cudaStream_t stream) {
  if (plan.n_active() == 0) return;
  const MoeFp8CallLayout cl = moe_fp8_call_layout(plan);
  BG_CHECK(call_buffer != nullptr && call_buffer_bytes >= cl.bytes, "moe fp8: call buffer of {} bytes, the plan "
           "needs {}", call_buffer_bytes, cl.bytes);
  std::vector<int64_t> host(plan.row_begin);
  host.push_back(plan.row_begin.back() + plan.rows.back());
  const std::vector<int64_t> r0 = fp8_scale_row0(plan);
  host.insert(host.end(), r0.begin(), r0.end());
  // From pageable memory: staged before cudaMemcpyAsync returns, so `host` may go out of scope.
  BG_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(call_buffer) + cl.table, host.data(),
                                host.size() * sizeof(int64_t), cudaMemcpyHostToDevice, stream));
}

void moe_expert_ffn_fp8_cuda(const MoeCudaParams& p, const MoeFp8Args& a, cudaStream_t stream) {
  moe_check_params(p);
  BG_CHECK(a.plan != nullptr && a.gemm != nullptr && (a.packed != nullptr || a.experts_host != nullptr),
           "moe fp8: null plan, GEMM or experts");
  const MoeGroupedPlan& plan = *a.plan;
  BG_CHECK(plan.hidden == p.hidden && plan.inter == p.inter, "moe fp8: plan [{} -> {}] launched with [{} -> {}]",
           plan.hidden, plan.inter, p.hidden, p.inter);
  BG_CHECK(moe_fp8_supported(p, a.packed != nullptr, a.experts_host != nullptr),
           "moe fp8: {} experts [{} -> {}]{} are not supported (MXFP4 in the W4A16 layout or FP8-block experts, widths "
           "multiples of 16)", weight_format_name(p.expert_format), p.hidden, p.inter,
           a.packed != nullptr ? " in the W4A16 layout" : "");
  BG_CHECK(a.ws.x_perm && a.ws.y_perm && a.ws.error_flags, "moe fp8: incomplete dispatch workspace");
  if (plan.n_active() == 0) return;
  const MoeFp8CallLayout cl = moe_fp8_call_layout(plan);
  BG_CHECK(a.call_buffer != nullptr && a.call_buffer_bytes >= cl.bytes &&
               reinterpret_cast<uintptr_t>(a.call_buffer) % 256 == 0,
           "moe fp8: call buffer of {} bytes, the plan needs {} (256-byte aligned)", a.call_buffer_bytes, cl.bytes);
  const MoeFp8ExpertLayout el = moe_fp8_expert_layout(p.hidden, p.inter);
  if (a.packed != nullptr) {
    int64_t most = 0;
    for (const MoeGroupedGroup& g : plan.groups) most = std::max<int64_t>(most, g.n_experts);
    BG_CHECK(a.expert_scratch != nullptr && a.expert_scratch_bytes >= static_cast<size_t>(most) * el.bytes,
             "moe fp8: expert scratch of {} bytes, the plan's largest group needs {}", a.expert_scratch_bytes,
             static_cast<size_t>(most) * el.bytes);
  }
  auto* buf = static_cast<uint8_t*>(a.call_buffer);
  uint8_t* x8 = buf + cl.x;
  auto* x_scale = reinterpret_cast<float*>(buf + cl.x_scale);
  uint8_t* h8 = buf + cl.h;
  auto* h_scale = reinterpret_cast<float*>(buf + cl.h_scale);
  auto* gu = reinterpret_cast<bf16*>(buf + cl.gu);
  auto* tail = reinterpret_cast<bf16*>(buf + cl.tail);
  auto* table = reinterpret_cast<int64_t*>(buf + cl.table);
  auto* block_scale = reinterpret_cast<float*>(buf + cl.block_scale);
  // An FP8-block matrix's scales as cuBLASLt reads them: as stored, or copied into padded rows (fp8_block_scale_ld).
  // One matrix at a time: the next copy is ordered after the GEMM that read the last one.
  const auto block_scales = [&](const DeviceWeight& w) {
    const int64_t blocks = fp8_blocks(w.n_in), ld = fp8_block_scale_ld(w.n_in);
    if (blocks == ld) return static_cast<const float*>(w.scale);
    BG_CUDA_CHECK(cudaMemcpy2DAsync(block_scale, static_cast<size_t>(ld) * sizeof(float), w.scale,
                                    static_cast<size_t>(blocks) * sizeof(float), static_cast<size_t>(blocks) *
                                    sizeof(float), static_cast<size_t>(fp8_blocks(w.n_out)), cudaMemcpyDeviceToDevice,
                                    stream));
    return static_cast<const float*>(block_scale);
  };
  const std::vector<int64_t> scale_row0 = fp8_scale_row0(plan);
  const auto n_active = static_cast<int>(plan.n_active());
  const int64_t H = p.hidden, I = p.inter, total_rows = plan.row_begin.back() + plan.rows.back();
  const int x_grid = grid_for(total_rows * fp8_blocks(H) * 32, 132 * 16);
  quantize_rows_kernel<<<x_grid, kThreads, 0, stream>>>(a.ws.x_perm, total_rows, H, table, n_active, x8, x_scale);
  BG_CUDA_CHECK_LAUNCH();
  const auto Hi = static_cast<int>(H), Ii = static_cast<int>(I);
  for (const MoeGroupedGroup& g : plan.groups) {
    if (a.packed != nullptr) moe_fp8_convert_w4a16_cuda(plan, g, *a.packed, a.expert_scratch, a.ws.error_flags, stream);
    for (int j = 0; j < g.n_experts; ++j) {
      const auto i = static_cast<size_t>(g.first + j);
      const int64_t rb = plan.row_begin[i];
      MoeFp8Gemm::Problem gp;
      gp.n = static_cast<int>(fp8_padded_rows(plan.rows[i]));  // kFp8RowAlign: the padding rows' outputs are spare
      gp.k = Hi;
      gp.b = x8 + rb * H;
      gp.b_scale = x_scale + fp8_blocks(H) * scale_row0[i];
      gp.ldd = 2 * Ii;
      bf16* d = gu + (rb - g.row_begin) * 2 * I;
      if (a.packed != nullptr) {
        const uint8_t* e = static_cast<const uint8_t*>(a.expert_scratch) + static_cast<size_t>(j) * el.bytes;
        gp.m = 2 * Ii;
        gp.a = e + el.gate_up;
        gp.a_scale = reinterpret_cast<const float*>(e + el.gate_up_scale);
        gp.d = d;
        a.gemm->run(gp, a.cublas_workspace, a.cublas_workspace_bytes, stream);
      } else {
        const ExpertWeightsCuda& e = a.experts_host[plan.slots[i]];
        gp.m = Ii;
        gp.a_mode = Fp8ScaleMode::kBlock128;
        for (const DeviceWeight* w : {&e.gate, &e.up}) {
          BG_CHECK(w->format == WeightFormat::kFp8Block && w->n_out == I && w->n_in == H && w->data && w->scale,
                   "moe fp8: slot {} has a [{} x {}] {} expert matrix, expected FP8-block [{} x {}]", plan.slots[i],
                   w->n_out, w->n_in, weight_format_name(w->format), I, H);
          gp.a = w->data;
          gp.a_scale = block_scales(*w);
          gp.d = w == &e.gate ? d : d + I;
          a.gemm->run(gp, a.cublas_workspace, a.cublas_workspace_bytes, stream);
        }
      }
    }
    const int glu_grid = grid_for(g.n_rows * fp8_blocks(I) * 32, 132 * 16);
    glu_quantize_kernel<<<glu_grid, kThreads, 0, stream>>>(gu, g.n_rows, g.row_begin, I, p.act, table, n_active,
                                                           h8, h_scale);
    BG_CUDA_CHECK_LAUNCH();
    for (int j = 0; j < g.n_experts; ++j) {
      const auto i = static_cast<size_t>(g.first + j);
      const int64_t rb = plan.row_begin[i];
      MoeFp8Gemm::Problem dp;
      dp.m = Hi;
      dp.n = static_cast<int>(fp8_padded_rows(plan.rows[i]));
      dp.k = Ii;
      dp.b = h8 + rb * I;
      dp.b_scale = h_scale + fp8_blocks(I) * scale_row0[i];
      // The padding rows' y lands on the next experts' rows (written after this) or, where it would run past y_perm
      // (fp8_y_spills), in the tail buffer, whose real rows are then copied out.
      const bool spills = fp8_y_spills(plan, i);
      dp.d = spills ? static_cast<void*>(tail) : static_cast<void*>(a.ws.y_perm + rb * H);
      dp.ldd = Hi;
      if (a.packed != nullptr) {
        const uint8_t* e = static_cast<const uint8_t*>(a.expert_scratch) + static_cast<size_t>(j) * el.bytes;
        dp.a = e + el.down;
        dp.a_scale = reinterpret_cast<const float*>(e + el.down_scale);
      } else {
        const DeviceWeight& w = a.experts_host[plan.slots[i]].down;
        BG_CHECK(w.format == WeightFormat::kFp8Block && w.n_out == H && w.n_in == I && w.data && w.scale,
                 "moe fp8: slot {} has a [{} x {}] {} down matrix, expected FP8-block [{} x {}]", plan.slots[i],
                 w.n_out, w.n_in, weight_format_name(w.format), H, I);
        dp.a = w.data;
        dp.a_scale = block_scales(w);
        dp.a_mode = Fp8ScaleMode::kBlock128;
      }
      a.gemm->run(dp, a.cublas_workspace, a.cublas_workspace_bytes, stream);
      if (spills) {
        BG_CUDA_CHECK(cudaMemcpyAsync(a.ws.y_perm + rb * H, tail, static_cast<size_t>(plan.rows[i] * H) * sizeof(bf16),
                                      cudaMemcpyDeviceToDevice, stream));
      }
    }
  }
}

}  // namespace bg::ops

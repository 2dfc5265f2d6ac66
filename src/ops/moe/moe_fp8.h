// The FP8 prefill path of the expert FFN, host side (no CUDA types; the device half is moe_fp8_cuda.h): the E4M3
// encoding, the block scales, the layouts of the converted experts and of the quantized rows, and a host emulation of
// the whole path for the tests. Opt-in (BG_MOE_PREFILL=fp8): E4M3 activations round to 3 mantissa bits, so this path
// does not compute the model exactly; docs/MOE_PREFILL.md ("The FP8 path") states what it changes.
//
// Each projection runs as one cuBLASLt FP8 GEMM per expert with DeepSeek-V3's block scaling on Hopper: every operand
// is E4M3 with one fp32 scale per 128 consecutive inputs of a row (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F), or for
// a checkpoint's FP8 experts their own 128 x 128 block scales (BLK128x128_32F). Value = code x scale.
//
// - MXFP4 weights convert exactly: a weight is c x 2^e (c in {0, 0.5, ..., 6}); under a power-of-two scale 2^S for
//   its 128 inputs it is c x 2^(e - S) in E4M3, exact for e - S in [-8, 6]. S is the smallest with max |w| <= 448 x
//   2^S, so every 128-input block whose four groups' scales span at most 14 binades converts bit for bit (checked by
//   the conversion's test against the bf16 dequantization).
// - Activations (x rows, then h = GLU(gate, up) in fp32) take scale = amax / 448 per 128 inputs and round to nearest
//   even; an all-zero block has scale 1 (the ll exchange's FP8 payload, the same arithmetic). E4M3 codes on the host:
//   core/dtype.h (f32_to_f8e4m3, the device's __nv_cvt_float_to_fp8 with __NV_SATFINITE).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ops/moe/moe_grouped.h"

// Shared word for word by the host emulation and the kernels.
#if defined(__CUDACC__)
#define BG_FP8_HD __host__ __device__ __forceinline__
#else
#define BG_FP8_HD inline
#endif

namespace bg::ops {

inline constexpr int64_t kFp8BlockInputs = 128;  // inputs per block scale
inline constexpr float kE4m3Max = 448.0f;

// Block scales per row of `n_in` inputs: ceil(n_in / 128).
BG_FP8_HD int64_t fp8_blocks(int64_t n_in) { return (n_in + kFp8BlockInputs - 1) / kFp8BlockInputs; }

// The exponent S of a weight block's power-of-two scale: the smallest integer with amax <= 448 x 2^S (amax = max |w|
// over the block, finite); 0 for amax == 0. With amax = f x 2^x (f in [0.5, 1)) and 448 = 0.875 x 2^9: x - 9 when f
// <= 0.875, else x - 8.
BG_FP8_HD int fp8_weight_scale_exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  int x = 0;
  const float f = frexpf(amax, &x);
  return f <= 0.875f ? x - 9 : x - 8;
}

// The conversion of W4A16-layout weights (moe_fp8_cuda.cu): a weight there is the bf16 lane c x 2^-126 (c the E2M1
// value) times the stored scale 2^(s' - 127), rounded to bf16, times 2^shift, rounded again. When s' >= 121 and
// s' + shift <= 377 neither rounding changes anything (c has two significant bits, c x 2^(s' - 253) >= 2^-133 is at
// worst a bf16 subnormal, and c x 2^(s' - 253 + shift) <= 6 x 2^124 is finite), so the weight under the block scale
// 2^S is c x 2^e with e = fp8_convert_exponent(s', shift, S): (lane x 2^126) x 2^e, two exact fp32 products (or one
// rounding where 2^e is subnormal, as ldexp's; below 2^-149 both give E4M3 zero). Elsewhere the kernel takes the
// bf16 arithmetic weight by weight.
BG_FP8_HD bool fp8_convert_fast(int s_prime, int shift) { return s_prime >= 121 && s_prime + shift <= 377; }
BG_FP8_HD int fp8_convert_exponent(int s_prime, int shift, int block_exponent) {
  return s_prime - 253 + shift - block_exponent;
}

// The activation scale of a block: amax / 448 (IEEE division on both sides), or 1 for amax == 0.
BG_FP8_HD float fp8_activation_scale(float amax) { return amax > 0.0f ? amax / kE4m3Max : 1.0f; }

// One converted expert in the FP8 scratch: gate|up as one [2 inter, hidden] E4M3 matrix (gate rows first), down
// [hidden, inter]; their VEC128 scales [fp8_blocks(hidden)][2 inter] and [fp8_blocks(inter)][hidden] (the rows of a
// block contiguous, as cuBLASLt reads them). Every part starts 256-byte aligned.
struct MoeFp8ExpertLayout {
  size_t gate_up = 0, down = 0, gate_up_scale = 0, down_scale = 0;  // byte offsets
  size_t bytes = 0;                                                  // one expert, rounded up to 256
};
MoeFp8ExpertLayout moe_fp8_expert_layout(int64_t hidden, int64_t inter);

// cuBLASLt (13.1, H200) runs the block-scaled GEMMs only for a row count n that is a multiple of 16 (it refused 1, 5,
// 39, 61 and took 64: bench/RESULTS.md, 2026-12-06), so every expert's GEMMs run over its rows padded to 16: the
// padding rows read whatever follows (the next expert's rows, or the buffers' 16 spare rows at the end) and their
// outputs land on rows that are written again later or are spare (y through a tail buffer where it would not be).
inline constexpr int64_t kFp8RowAlign = 16;
BG_FP8_HD int64_t fp8_padded_rows(int64_t rows) { return (rows + kFp8RowAlign - 1) / kFp8RowAlign * kFp8RowAlign; }
// Whether touched expert i's padded rows run past the call's last row (the experts after it hold fewer rows than its
// padding; always possible for the last one). The dispatch's y_perm has no spare rows, so such an expert's down GEMM
// writes into the tail buffer and its real rows are copied out.
bool fp8_y_spills(const MoeGroupedPlan& plan, size_t i);

// FP8-block experts' 128 x 128 scales, [fp8_blocks(n_out)][fp8_blocks(n_in)] as stored, go to cuBLASLt as they are
// when a row of them is a multiple of 4 floats (every DeepSeek-V3 / Kimi-K2 matrix: 56 or 16 blocks); otherwise the
// call first copies them into rows of fp8_block_scale_ld floats (the layout cuBLASLt 13.1 reads: with unpadded rows
// of 1 or 3 blocks and more than one row, the down projections of the small parity cases came out wrong on the H100;
// with padded rows they pass on the H200, bench/RESULTS.md, 2026-12-06).
BG_FP8_HD int64_t fp8_block_scale_ld(int64_t n_in) { return (fp8_blocks(n_in) + 3) / 4 * 4; }

// The quantized rows of one call: E4M3 [rows, width] in the dispatch's permuted order (plus kFp8RowAlign spare rows),
// and per touched expert i its scales [fp8_blocks(width)][padded rows_i] (the rows of a block contiguous: how
// cuBLASLt reads an operand's 1 x 128 scales) at fp8_blocks(width) x scale_row0_i floats, scale_row0 the prefix sum of
// the experts' padded rows. scale_index: where row `r` of the expert (0 .. rows_i - 1) keeps block `b`'s scale.
BG_FP8_HD int64_t fp8_row_scale_index(int64_t width, int64_t scale_row0, int64_t rows, int64_t r, int64_t b) {
  return fp8_blocks(width) * scale_row0 + b * fp8_padded_rows(rows) + r;
}
// scale_row0 of every touched expert of the plan, then the total (n_active + 1 entries).
std::vector<int64_t> fp8_scale_row0(const MoeGroupedPlan& plan);

// Device bytes of the per-call buffers: x (E4M3 [total rows + 16, hidden] + scales), h (E4M3 [total rows + 16,
// inter] + scales), gate|up outputs of the largest group (bf16 [rows + 16, 2 inter]), the padded y rows of the largest
// expert that spills (fp8_y_spills; bf16 [padded rows, hidden]), the experts' table (int64: the first rows then
// scale_row0, n_active + 1 each) and room for one FP8-block matrix's padded scales (fp8_block_scale_ld). Each part
// 256-byte aligned.
struct MoeFp8CallLayout {
  size_t x = 0, x_scale = 0, h = 0, h_scale = 0, gu = 0, tail = 0, table = 0, block_scale = 0;  // byte offsets
  size_t bytes = 0;
};
MoeFp8CallLayout moe_fp8_call_layout(const MoeGroupedPlan& plan);

// ---- Host emulation (tests) ----------------------------------------------------------------------------------------
// Quantizes rows [rows, width] (fp32 values) as the device does: per 128 inputs scale = fp8_activation_scale(amax),
// codes = e4m3_from_float(v / scale). Returns the dequantized values (code x scale), the operand cuBLASLt multiplies.
std::vector<float> fp8_quantize_rows_emulated(std::span<const float> x, int64_t rows, int64_t width);
// A weight matrix [n_out, n_in] (fp32, exact MXFP4 / bf16 values) as the conversion leaves it: per row and 128 inputs
// the power-of-two scale, codes rounded to E4M3. Returns code x scale (equal to w wherever the block converts exactly)
// and counts the blocks that do not.
std::vector<float> fp8_convert_weight_emulated(std::span<const float> w, int64_t n_out, int64_t n_in,
                                               int64_t* inexact_blocks = nullptr);

}  // namespace bg::ops

// The dense decode GEMM's launch geometry (linear_decode_cuda.cu): tile shape by token count, the k-split that spreads
// a few row tiles over the GPU, and the workspace it needs. Plain host code, shared with the CPU tests.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace bg::ops {

// y[n, out] = x[n, in] W^T for dense bf16 W and 1..kDenseDecodeMaxTokens tokens, weights streamed once.
inline constexpr int64_t kDenseDecodeMaxTokens = 64;
inline constexpr int kDenseDecodeStageK = 64;        // inputs per pipeline stage (n_in must be a multiple)
inline constexpr int kDenseDecodeMinSplitStages = 8;  // a k-split gets at least this many stages

struct DenseDecodePlan {
  int nb = 0;            // n8 token blocks per pass (1, 2, 4 or 8): tokens padded to 8 * nb
  int m_tiles = 0;       // m16 tiles per warp (1 or 2): a CTA of 8 warps owns 128 * m_tiles rows
  int rows = 0;          // rows per CTA tile
  int ctas_per_sm = 0;   // resident CTAs per SM the kernel is built for
  int64_t tiles = 0;     // row tiles
  int64_t stages = 0;    // k-stages of the whole input
  int splits = 1;        // k-splits per tile: CTAs = tiles * splits
  size_t slot_floats = 0;  // fp32 partial sums of one (tile, split) when splits > 1
};

// nb / m_tiles by token count: up to 32 tokens one m16 tile per warp (two CTAs per SM); 33-64 tokens two (one CTA per
// SM), so the activations re-read per row tile stay a quarter of the weight bytes. splits: enough CTAs for the
// resident slots (ctas_per_sm * sms) when the row tiles alone are fewer, at least kDenseDecodeMinSplitStages stages
// each, within the partial-sum buffer and the counters; `forced` > 0 asks for that many (still capped so).
inline DenseDecodePlan dense_decode_plan(int64_t n_out, int64_t n_in, int64_t n_tokens, int sms, size_t partial_bytes,
                                         int64_t n_counters, int forced = 0) {
  DenseDecodePlan p;
  const int64_t blocks = (n_tokens + 7) / 8;
  p.nb = blocks <= 1 ? 1 : blocks <= 2 ? 2 : blocks <= 4 ? 4 : 8;
  p.m_tiles = p.nb == 8 ? 2 : 1;
  p.rows = 128 * p.m_tiles;
  p.ctas_per_sm = p.m_tiles == 2 ? 1 : 2;
  p.tiles = (n_out + p.rows - 1) / p.rows;
  p.stages = n_in / kDenseDecodeStageK;
  p.slot_floats = static_cast<size_t>(p.rows) * static_cast<size_t>(8 * p.nb);
  const int64_t slots = static_cast<int64_t>(p.ctas_per_sm) * sms;
  int64_t s = forced > 0 ? std::min<int64_t>(forced, std::max<int64_t>(1, p.stages))
                         : std::min(std::max<int64_t>(1, slots / std::max<int64_t>(1, p.tiles)),
                                    std::max<int64_t>(1, p.stages / kDenseDecodeMinSplitStages));
  while (s > 1 && static_cast<size_t>(p.tiles * s) * p.slot_floats * sizeof(float) > partial_bytes) --s;
  if (p.tiles > n_counters) s = 1;
  p.splits = static_cast<int>(s);
  return p;
}

}  // namespace bg::ops

// MLA prefill in the non-absorbed form (FlashAttention class), host side: which sequences of a step take it, how
// their cached context is cut into passes of bounded size, and the per-CTA work items. No CUDA types: CPU builds
// compile it and the CPU tests check it.
//
// A sequence with at least min_tokens query tokens in the step ("a prefill sequence") takes this path. Its context
// (cache positions 0..max position of its tokens) is gathered from the paged latent cache and expanded per head with
// kv_b_proj (k_nope = W_UK c, v = W_UV c), then causal attention with q/k head dim nope + rope and v head dim v runs
// on tensor cores, each query token seeing the positions up to its own. The contexts of all prefill sequences,
// concatenated in sequence order, are cut into passes of at most max_pass_rows gathered rows, so the expanded K/V
// workspace is bounded whatever the context length; a query tile whose keys span several passes carries its
// unnormalised softmax state (o, max, sum) from one pass to the next in fp32. The other sequences (by default those
// of one token: decode tokens in a mixed step) keep the absorbed form, where one query token reads the 576-value
// latents directly. Expanding a context costs about as much as one token's absorbed attention on the general
// (CUDA-core) kernel, so from two query tokens on the expansion pays for itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ops/mla/mla.h"

namespace bg::ops {

// The head dims the kernel is built for (DeepSeek-V3, Kimi-K2, Kimi-K3: nope 128, rope 64, v 128). Smaller dims
// (test checkpoints) run the same kernel zero-padded to these.
inline constexpr int64_t kMlaPrefillNope = 128;
inline constexpr int64_t kMlaPrefillRope = 64;
inline constexpr int64_t kMlaPrefillV = 128;
inline constexpr int64_t kMlaPrefillQk = kMlaPrefillNope + kMlaPrefillRope;
inline constexpr int64_t kMlaPrefillTileQ = 128;  // query tokens per CTA
inline constexpr int64_t kMlaPrefillTileK = 64;   // keys per inner tile

struct MlaPrefillOptions {
  int64_t min_tokens = 2;           // query tokens a sequence needs in the step to take the prefill path
  int64_t max_pass_rows = 16384;    // gathered context rows per pass (bounds the K/V workspace)
};

// Gathered rows [row0, row0 + len) of a pass hold cache positions [k0, k0 + len) of step sequence `seq`.
struct MlaPrefillSegment {
  int32_t seq = 0;
  int32_t k0 = 0;
  int32_t len = 0;
  int32_t row0 = 0;
};

// Flags of a work item.
inline constexpr int32_t kMlaPrefillLoadState = 1;  // continue from the state an earlier pass stored
inline constexpr int32_t kMlaPrefillFinal = 2;      // the tile's last keys: write the normalised output, not the state

// One CTA's work (times n_heads): query rows [q_row0, q_row0 + n_rows) of the step (tokens of one sequence) against
// the keys of one segment: gathered rows g0 .. g0 + n_keys - 1, cache positions k0 .. k0 + n_keys - 1. Keys before
// mask_from (relative to k0) are visible to every row of the tile; from there on each row masks positions past its
// own. 8 int32, the layout the kernel reads.
struct MlaPrefillItem {
  int32_t q_row0 = 0;
  int32_t n_rows = 0;
  int32_t g0 = 0;
  int32_t k0 = 0;
  int32_t n_keys = 0;
  int32_t mask_from = 0;
  int32_t flags = 0;
  int32_t reserved = 0;
};
static_assert(sizeof(MlaPrefillItem) == 32);

struct MlaPrefillPass {
  int64_t rows = 0;           // gathered rows
  int64_t segment_begin = 0;  // into MlaPrefillPlan::segments
  int64_t n_segments = 0;
  int64_t item_begin = 0;  // into MlaPrefillPlan::items
  int64_t n_items = 0;
};

// cuDNN's fused attention (mla_prefill_cudnn.h) takes a pass as at most two ragged calls. A segment's queries that
// fall inside its positions form a causal piece aligned at the bottom right (the piece's last query sees exactly the
// keys up to its own position); its queries after the segment form a full piece (every key of it visible). A piece
// from the segment at position 0 is the first for its queries; a causal piece holds their own positions, so it is
// their last. Possible when every prefill sequence's tokens are consecutive positions (the scheduler's layout).
inline constexpr int32_t kMlaPieceFirst = 1;
inline constexpr int32_t kMlaPieceFinal = 2;
struct MlaPrefillPiece {
  int32_t q_row0 = 0;  // step rows [q_row0, q_row0 + n_q)
  int32_t n_q = 0;
  int32_t g0 = 0;  // gathered rows [g0, g0 + n_kv) of the pass
  int32_t n_kv = 0;
  int32_t flags = 0;  // kMlaPieceFirst | kMlaPieceFinal
  int32_t index = 0;  // batch index within its call
  int32_t reserved[2] = {0, 0};
};
static_assert(sizeof(MlaPrefillPiece) == 32);

struct MlaPrefillCudnnCall {
  int64_t pass = 0;
  bool causal = true;       // bottom-right causal, else every key visible
  bool direct = true;       // every piece first and final: the output is written in place, no merge
  int64_t piece_begin = 0;  // into MlaPrefillPlan::pieces
  int64_t n_pieces = 0;     // pieces of the call
  int64_t batch = 0;        // the launch's batch B: n_pieces rounded up (mla_prefill_cudnn_batch), so steps share plans
  int64_t max_q = 0;        // longest query run of a piece
  int64_t max_kv = 0;       // longest key run of a piece
  bool uniform = false;     // every piece has max_q queries and max_kv keys, and n_pieces == batch (no padding)
  int64_t kv_row0 = 0;      // the first piece's first gathered row (g0)
  int64_t meta = 0;         // byte offset of its arrays (below) in the workspace's cudnn region
};

// The batch a call of n pieces launches with: the next power of two. cuDNN's plans are built per batch (a build takes
// 0.05-1.5 s), so rounding up lets a serving process with up to 64 prefill sequences per step build 7 plans per length
// bucket instead of 64. The entries past the pieces are empty sequences (lengths 0, offsets at the end).
inline constexpr int64_t mla_prefill_cudnn_batch(int64_t n) {
  int64_t b = 1;
  while (b < n) b *= 2;
  return b;
}

// The arrays of a call of batch B: six int32 arrays at call.meta, each mla_prefill_cudnn_stride(B) ints apart
// (16-byte aligned): seq_len_q [B], seq_len_kv [B], then element offsets (ragged layout, B + 1 each) of q [tokens,
// heads, 192] from the first piece's first query row, of k [rows, heads, 192] and v [rows, heads, 128] from row 0 of
// the pass, and of the output [tokens, heads, 128] from the first piece's first query row. Padding entries (past the
// pieces) have lengths 0 and the offsets of the end.
inline constexpr int64_t mla_prefill_cudnn_stride(int64_t n) { return (n + 1 + 3) / 4 * 4; }
inline constexpr int64_t mla_prefill_cudnn_ints(int64_t n) { return 6 * mla_prefill_cudnn_stride(n); }

// Everything the prefill launch of one step needs, made from the step layout on the host (the same for every MLA
// layer of the step).
struct MlaPrefillPlan {
  std::vector<int32_t> prefill_seqs;                       // step sequences that take the prefill path
  // Maximal token ranges [begin, end) of the other sequences (with the default min_tokens, single-token sequences
  // only: the decode kernel can take each run).
  std::vector<std::pair<int64_t, int64_t>> absorbed_runs;
  bool absorbed_single_tokens = true;  // every sequence in absorbed_runs has one token in the step
  std::vector<MlaPrefillSegment> segments;
  std::vector<MlaPrefillItem> items;  // per pass, heaviest first
  std::vector<MlaPrefillPass> passes;
  // The cuDNN form of the passes (empty when some prefill sequence's tokens are not consecutive positions).
  std::vector<MlaPrefillPiece> pieces;
  std::vector<MlaPrefillCudnnCall> cudnn_calls;  // in pass order, at most two per pass
  int64_t max_pass_rows = 0;  // largest pass
  bool needs_state = false;   // some tile spans more than one pass
  int64_t cudnn_bytes = 0;    // the arrays of all cuDNN calls

  bool empty() const { return prefill_seqs.empty(); }
};

// Whether the prefill kernel takes these head dims: qk_nope <= 128, qk_rope <= 64, v_head <= 128, kv_lora >= 1.
bool mla_prefill_takes(const MlaParams& p);

// The plan for a step: positions [n_tokens] (each token's position in its sequence), seq_begin [n_seqs + 1] (token
// ranges, contiguous per sequence). Throws bg::Error on a malformed layout or bad options. A sequence whose tokens'
// positions are not all in [0, 2^31 - 2^16) never takes the prefill path.
MlaPrefillPlan mla_prefill_plan(std::span<const int64_t> positions, std::span<const int64_t> seq_begin,
                                const MlaPrefillOptions& options = {});

// Whether the plan has a cuDNN form whose element offsets fit the int32 arrays cuDNN reads, for a step of n_tokens
// tokens at n_heads heads.
bool mla_prefill_cudnn_fits(const MlaPrefillPlan& plan, int64_t n_tokens, int64_t n_heads);

// Byte offsets of the regions of one prefill workspace (each 256-byte aligned).
struct MlaPrefillWorkspace {
  size_t segments = 0;  // int32 [plan.segments.size(), 4]
  size_t items = 0;     // int32 [plan.items.size(), 8]
  size_t q_pad = 0;     // bf16 [n_tokens, n_heads, 192] (only when the head dims are not 128 / 64)
  size_t c_kv = 0;      // bf16 [max_pass_rows, kv_lora]
  size_t k_pe = 0;      // bf16 [max_pass_rows, 64], zero past rope
  size_t k_nope = 0;    // bf16 [max_pass_rows, n_heads, 128], zero past nope; [.., 192] (k_nope | k_pe) for cuDNN
  size_t v = 0;         // bf16 [max_pass_rows, n_heads, 128], zero past v_head
  size_t state_o = 0;   // fp32 [n_tokens, n_heads, 128] (only when plan.needs_state)
  size_t state_ml = 0;  // fp32 [n_tokens, n_heads, 2]
  size_t o_part = 0;    // bf16 [n_tokens, n_heads, 128]: a cuDNN piece's output before its merge (plan.needs_state)
  size_t pieces = 0;    // int32 [plan.pieces.size(), 8] (uploaded)
  size_t cudnn = 0;     // int32 arrays of the cuDNN calls (MlaPrefillCudnnCall::meta; uploaded)
  size_t total_bytes = 0;
  int64_t n_heads = 0;  // of the params it was made for (the cuDNN offsets count elements)
  int64_t n_tokens = 0;
  size_t meta_bytes = 0;  // segments + items + pieces + cudnn: the part uploaded from the host
};
MlaPrefillWorkspace mla_prefill_workspace(const MlaParams& p, const MlaPrefillPlan& plan);

// The metadata bytes the launch reads from the start of the workspace (segments, items, pieces, cuDNN arrays), as the
// host writes them (meta_bytes long).
std::vector<std::byte> mla_prefill_meta(const MlaPrefillPlan& plan, const MlaPrefillWorkspace& ws);

// Attention FLOPs of the plan's prefill tokens (2 (qk + v) per visible (query, key) pair per head), for benchmarks.
double mla_prefill_flops(const MlaParams& p, std::span<const int64_t> positions, const MlaPrefillPlan& plan,
                         std::span<const int64_t> seq_begin);

}  // namespace bg::ops

// MLA absorbed decode (FlashMLA class), host side: the plan (head groups, KV partitions, workspace layout) and the
// split-KV schedule arithmetic that the CUDA kernels and the CPU tests share. No CUDA types: CPU builds compile it.
//
// Decode only: one query token per sequence. Token t attends to cache positions 0..positions[t] of its sequence, cut
// into tiles of 64 positions. The tiles of all tokens, concatenated in token order, are split into `n_used`
// contiguous, equally sized partitions (one CTA per partition and head group). A token whose tiles fall into more
// than one partition is "split": each piece writes an unnormalised fp32 partial (o, max, sum) into a slot of the
// workspace and a combine kernel merges the pieces in partition order (fixed order: bitwise reproducible). Which
// partition a tile falls into depends only on the step's positions, so a graph replay computes what the eager launch
// computes, bit for bit. (Not batch invariant: a token's cut points depend on the other tokens' lengths.) When the
// even cut splits many tokens and whole tokens balance almost as well (a batch of about one token per partition, or a
// few), the device may take the token-aligned schedule instead: every token whole in the partition holding its
// middle tile, so nothing is merged (MlaDecodeOptions::align_tokens; the rule is
// mla_aligned_schedule_pays). The per-token schedule (MlaDecodeOptions::per_token, used under --deterministic) is: one
// partition per token, no split, so a token's result never depends on what else is in the step, at the price of
// fewer CTAs at small batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/mla/mla.h"

#if defined(__CUDACC__)
#define BG_MLA_HD __host__ __device__ __forceinline__
#else
#define BG_MLA_HD inline
#endif

namespace bg::ops {

// The latent shape the decode kernel is built for (DeepSeek-V3, Kimi-K2, Kimi-K3): cache entries of 512 + 64 bf16.
inline constexpr int64_t kMlaDecodeLora = 512;
inline constexpr int64_t kMlaDecodeRope = 64;
inline constexpr int64_t kMlaDecodeEntry = kMlaDecodeLora + kMlaDecodeRope;  // 576 bf16 = 1152 B
// Cache positions per schedule tile (the M of Q·Kᵀ in the heads-as-N kernels; the heads-as-M default walks each as
// two 32-position halves, its N).
inline constexpr int64_t kMlaDecodeTile = 64;
// Heads per CTA: the N of the heads-as-N kernels, the valid rows of the heads-as-M kernel's m64 operand (48 of 64);
// shared memory caps it.
inline constexpr int64_t kMlaDecodeMaxGroupHeads = 48;
inline constexpr int64_t kMlaDecodeMaxTokens = 1 << 16;

// Which attention kernel runs: the heads-as-N kernel on mma.sync or wgmma (same data flow and shared-memory layout),
// or the heads-as-M kernel. All three share the plan, the schedule, the combine and the workspace.
enum class MlaDecodeMma : uint8_t {
  kMmaSync,  // mma.sync.m16n8k16 fed by ldmatrix (sm_80+ path, about 0.2-0.3 of read at best)
  kWgmma,    // wgmma.mma_async m64nNk16 straight from shared memory (sm_90a)
  // Heads as the MMA M dimension (FlashMLA's orientation, sm_90a): a ring of four 32-position half tiles, Q·Kᵀ of the
  // next half issued before the P·V of this one, P straight from the accumulators (docs/MLA_DECODE.md).
  kWgmmaHeadsM,
};
const char* mla_decode_mma_name(MlaDecodeMma mma);
// BG_MLA_DECODE (`wgmma`, `heads_m`, `mmasync`): the backend's choice; unset: MlaDecodeOptions{}.mma.
MlaDecodeMma mla_decode_mma_from_env();

struct MlaDecodeOptions {
  MlaDecodeMma mma = MlaDecodeMma::kWgmmaHeadsM;  // the fastest on the H100 (docs/MLA_DECODE.md)
  int64_t n_partitions = 0;            // KV partitions; 0 = n_sms / head groups (one CTA per SM, one wave)
  int64_t min_tiles_per_partition = 2;  // fewer partitions when the step has few tiles
  bool per_token = false;  // one partition per token, never split (batch invariant); n_partitions must be 0
  // Let the device take the token-aligned schedule where it pays (mla_aligned_schedule_pays): on by default since it
  // measured faster (H100, 2026-12-07); BG_MLA_DECODE_ALIGN=0 turns it off.
  bool align_tokens = true;
};
// BG_MLA_DECODE_ALIGN (0 / 1): the backend's align_tokens; unset: MlaDecodeOptions{}.align_tokens.
bool mla_decode_align_from_env();

// Byte offsets of the regions of one decode workspace (each 256-byte aligned).
struct MlaDecodeWorkspace {
  size_t q_full = 0;   // bf16 [n_tokens, n_heads, 576]: W_UK-absorbed q_nope (512) | q_pe (64)
  size_t o_lat = 0;    // bf16 [n_tokens, n_heads, 512]: softmax-weighted latent sum, normalised
  size_t part_o = 0;   // fp32 [max_slots, n_groups, 512, group_heads]: unnormalised partial sums of split tokens
  size_t part_ml = 0;  // fp32 [max_slots, n_groups, 2, group_heads]: partial max (log2 units) and sum
  size_t meta = 0;     // int32 [MlaDecodeMeta::count]: the schedule
  size_t total_bytes = 0;
};

// int32 offsets inside the meta region: [0] total tiles, [1] partitions used, then tile_prefix[n_tokens + 1],
// n_splits[n_tokens] (partitions the token's tiles touch), slot_base[n_tokens] (first partial slot of a split token),
// first_partition[n_tokens] (partition of the token's first tile), partition_begin[n_partitions + 1] (first tile of
// each partition; total past the partitions used). The attention kernel reads boundaries from here instead of
// dividing: a 64-bit division is a branching subroutine, which makes ptxas serialise every wgmma of the kernel.
struct MlaDecodeMeta {
  static constexpr int64_t kTotalTiles = 0;
  static constexpr int64_t kPartitionsUsed = 1;
  static constexpr int64_t kTilePrefix = 2;
  static BG_MLA_HD int64_t n_splits(int64_t n_tokens) { return kTilePrefix + n_tokens + 1; }
  static BG_MLA_HD int64_t slot_base(int64_t n_tokens) { return n_splits(n_tokens) + n_tokens; }
  static BG_MLA_HD int64_t first_partition(int64_t n_tokens) { return slot_base(n_tokens) + n_tokens; }
  static BG_MLA_HD int64_t partition_begin(int64_t n_tokens) { return first_partition(n_tokens) + n_tokens; }
  static BG_MLA_HD int64_t count(int64_t n_tokens, int64_t n_partitions) {
    return partition_begin(n_tokens) + n_partitions + 1;
  }
};

// Everything a decode launch needs that depends only on the batch shape (never on positions): computed on the host
// before a step, so the launch itself can be captured in a CUDA graph and replayed with other positions.
struct MlaDecodePlan {
  MlaParams params;
  int64_t group_heads = 0;   // heads per CTA: a multiple of 16, <= 48 (the last group may be padded)
  int64_t n_groups = 0;      // ceil(n_heads / group_heads)
  int64_t n_partitions = 0;  // KV partitions (CTAs per head group)
  int64_t min_tiles_per_partition = 0;
  int64_t max_slots = 0;  // partial slots: split pieces never exceed 2 * partitions (0: per-token, nothing split)
  bool per_token = false;  // partition g is token g (n_partitions = n_tokens)
  bool align_tokens = false;  // the device may take the token-aligned schedule (never with per_token)
  MlaDecodeMma mma = MlaDecodeMma::kMmaSync;
  MlaDecodeWorkspace ws;
};

// Whether the decode kernel takes this latent shape (kv_lora 512, rope 64). Other shapes (small test checkpoints)
// keep the general kernel of mla_cuda.h; the CUDA backend chooses by this function, nothing else.
bool mla_decode_takes(const MlaParams& p);

// The plan for p.n_tokens decode tokens. Throws bg::Error for shapes the kernel does not take or bad options.
MlaDecodePlan mla_decode_plan(const MlaParams& p, int64_t n_sms, const MlaDecodeOptions& options = {});

// ---- split-KV schedule arithmetic (host and device) -------------------------------------------------------------

BG_MLA_HD int64_t mla_tiles_of_context(int64_t n_ctx) { return (n_ctx + kMlaDecodeTile - 1) / kMlaDecodeTile; }

// Partitions actually used: at least min_tiles tiles each, at most n_partitions, at least 1 (total_tiles >= 1).
BG_MLA_HD int64_t mla_partitions_used(int64_t total_tiles, int64_t n_partitions, int64_t min_tiles) {
  const int64_t by_size = (total_tiles + min_tiles - 1) / min_tiles;
  const int64_t n = by_size < n_partitions ? by_size : n_partitions;
  return n < 1 ? 1 : n;
}

// First tile of partition g (g in [0, n_used]; g = n_used gives total). Partitions are non-empty when
// n_used <= total_tiles, which mla_partitions_used guarantees.
BG_MLA_HD int64_t mla_partition_begin(int64_t g, int64_t total_tiles, int64_t n_used) {
  return g * total_tiles / n_used;
}

// The partition holding global tile x: the largest g with begin(g) <= x, i.e. floor(((x + 1) * n_used - 1) / total).
BG_MLA_HD int64_t mla_partition_of(int64_t x, int64_t total_tiles, int64_t n_used) {
  return ((x + 1) * n_used - 1) / total_tiles;
}

// ---- the token-aligned schedule ----------------------------------------------------------------------------------
// Token t (tiles [lo, hi) of the concatenation) goes whole to its home partition: the even cut's partition of its
// middle tile. Homes never decrease with t, so partition g holds the tokens whose home is g, contiguous, and starts
// at the first tile of the first token whose home is g or later (the total when there is none; a partition may be
// empty).
BG_MLA_HD int64_t mla_home_partition(int64_t lo, int64_t hi, int64_t total_tiles, int64_t n_used) {
  return mla_partition_of(lo + (hi - lo - 1) / 2, total_tiles, n_used);
}

// One tile more on the busiest CTA against the merge of this many split tokens (their fp32 partials written, read
// back and combined). Measured on the H100 (K3, 4k contexts, bench/RESULTS.md 2026-12-07): whole tokens saved 18.4 us
// at batch 64 (one tile more, 64 tokens no longer split) and 7.8 us at batch 128 (three more), i.e. a tile ~5.3 us and
// a split token's merge ~0.37 us: about 14; 12 leans toward whole tokens. (Batch 256 at 4k, seven tiles more for the
// same ~64 merges, keeps the even cut.)
inline constexpr int64_t kMlaAlignSplitsPerTile = 12;

// Whether the token-aligned schedule replaces the even one: the even cut splits some token, and the aligned
// schedule's busiest partition (max_aligned tiles) is at most one tile per kMlaAlignSplitsPerTile split tokens above
// the even cut's (ceil(total / n_used)).
BG_MLA_HD bool mla_aligned_schedule_pays(int64_t max_aligned, int64_t total_tiles, int64_t n_used,
                                         int64_t n_split_even) {
  const int64_t max_even = (total_tiles + n_used - 1) / n_used;
  return n_split_even > 0 && (max_aligned - max_even) * kMlaAlignSplitsPerTile <= n_split_even;
}

// The schedule the device computes, computed on the host from the same positions (tests, and documentation of
// what the prep kernel writes into the meta region).
struct MlaDecodeSchedule {
  int64_t total_tiles = 0;
  int64_t n_used = 0;
  std::vector<int32_t> tile_prefix;  // [n_tokens + 1]
  std::vector<int32_t> n_splits;     // [n_tokens]
  std::vector<int32_t> slot_base;    // [n_tokens]: split pieces before this token's
  std::vector<int32_t> first_partition;  // [n_tokens]
  std::vector<int32_t> partition_begin;  // [n_partitions + 1]; total past n_used
  bool aligned = false;  // the token-aligned schedule (no token split; partitions may be empty)
};
MlaDecodeSchedule mla_decode_schedule_cpu(const MlaDecodePlan& plan, const int64_t* positions);

}  // namespace bg::ops

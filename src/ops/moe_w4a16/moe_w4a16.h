// Grouped W4A16 MXFP4 expert FFN (few rows per expert): the versioned weight layout (one contiguous block per expert,
// in the order the tensor-core kernel consumes it), its host-side builder and reader, the op's POD params (shared by
// the CPU reference and the CUDA launcher) and the CPU reference.
// Kernel design, layout diagram and performance model: moe_w4a16_cuda.cu. Included by CPU and CUDA code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "formats/quant.h"

namespace bg::ops {

// Bump whenever a byte of the layout below changes meaning: a launcher refuses a layout of another version.
// 2: one block per expert (gate/up then down), found through a per-slot pointer table (1: projection-major layer).
inline constexpr uint32_t kMoeW4a16LayoutVersion = 2;

// The two projections of an expert: gate and up (interleaved per 16-row tile so one warp holds matching gate/up
// accumulators for the fused GLU), and down.
enum class MoeW4a16Proj : uint8_t { kGateUp, kDown };

// One projection of an expert. The projection is cut into work items of 512 weight rows (gate/up: 256 gate rows + the
// 256 up rows of the same intermediate columns; down: 512 output rows) and k-stages of 64 inputs; each (item, k-stage)
// is one contiguous 17408-byte block (16 KiB of E2M1 codes in mma.sync A-fragment order, then 1 KiB of E8M0 scales),
// so a pipeline stage is one contiguous copy. Rows / inputs past the real shape are zero codes (padding; none at the
// DeepSeek-V3 and Kimi-K3 shapes).
struct MoeW4a16MatrixInfo {
  int64_t n_out = 0;         // gate/up: inter (intermediate columns of h); down: hidden
  int64_t n_in = 0;          // gate/up: hidden; down: inter
  int32_t n_items = 0;       // gate/up: ceil(inter / 256); down: ceil(hidden / 512)
  int32_t n_kstages = 0;     // ceil(n_in / 64)
  int64_t offset_bytes = 0;  // from the start of an expert's block
  int64_t slot_bytes = 0;    // of one expert: n_items * n_kstages * 17408
  // Stored scale bytes are s' = s + 126 - scale_shift (s = the checkpoint's E8M0 exponent); the kernel multiplies its
  // fp32 accumulators by 2^scale_shift. 0 unless some scale of the projection exceeds 2^1 (s > 128), see the .cu.
  int32_t scale_shift = 0;
};

// POD descriptor of one MoE layer's re-laid-out experts (the launcher's view; the blocks' device pointers travel
// beside it). Each expert is one block of block_bytes: gate/up at gate_up.offset_bytes (0), down at
// down.offset_bytes, 256-byte aligned; a block can live anywhere (a layer's allocation, a streamed-expert buffer).
// Packed contiguously (moe_w4a16_pack), slot s's block is at s * block_bytes of total_bytes.
struct MoeW4a16LayoutInfo {
  uint32_t version = kMoeW4a16LayoutVersion;
  int64_t n_slots = 0;  // local experts, indexed by the dispatch's expert id 0..n_slots-1
  int64_t hidden = 0;   // expert input and output width (DeepSeek-V3 7168; Kimi-K3 latent 3584)
  int64_t inter = 0;    // expert intermediate width (2048; 3072)
  MoeW4a16MatrixInfo gate_up;
  MoeW4a16MatrixInfo down;
  int64_t block_bytes = 0;  // one expert (a multiple of 256)
  int64_t total_bytes = 0;  // n_slots * block_bytes
};

// One expert's weights as loaded from the checkpoint (views; all MXFP4): gate/up [inter, hidden], down [hidden, inter].
struct MoeW4a16ExpertView {
  const QuantWeight* gate = nullptr;
  const QuantWeight* up = nullptr;
  const QuantWeight* down = nullptr;
};

// The layout geometry for a shape (scale shifts 0). Throws for widths that are not positive multiples of 32.
MoeW4a16LayoutInfo moe_w4a16_layout_info(int64_t n_slots, int64_t hidden, int64_t inter);

// The layout of experts [0, n_slots) with the scale shifts they need (one per projection, over every expert, so any
// expert's block can go into any slot of the layer). Checks every expert's format (MXFP4) and shape, and rejects an
// E8M0 scale of 0xFF (NaN) naming expert, projection, row and group.
MoeW4a16LayoutInfo moe_w4a16_layer_info(std::span<const MoeW4a16ExpertView> experts, int64_t hidden, int64_t inter);

// Packs one expert (checked as above; its scales must fit info's shifts) into `block` (info.block_bytes). Writes every
// byte (the alignment gaps as zeros), so the block need not be initialised. Parallel over the expert's stage blocks.
void moe_w4a16_pack_expert(const MoeW4a16LayoutInfo& info, const MoeW4a16ExpertView& expert, int64_t slot,
                           std::span<std::byte> block);

// moe_w4a16_layer_info, then every expert's block into `dst` (info.total_bytes, host memory), slot s at
// s * block_bytes. Returns the info.
MoeW4a16LayoutInfo moe_w4a16_pack(std::span<const MoeW4a16ExpertView> experts, int64_t hidden, int64_t inter,
                                  std::span<std::byte> dst);

// Reads a projection of one expert back out of its block, decoding exactly as the kernel does (bit placement, scale
// fold, 2^scale_shift): fp32 [n_out, n_in], or for gate/up the gate (which = 0) or up (which = 1) half. For tests
// and debugging: a correct layout gives back QuantWeight::decode_all() bit for bit.
std::vector<float> moe_w4a16_unpack_block(const MoeW4a16LayoutInfo& info, std::span<const std::byte> block,
                                          MoeW4a16Proj proj, int which = 0);
// The same for slot `slot` of a contiguous layer (info.total_bytes).
std::vector<float> moe_w4a16_unpack(const MoeW4a16LayoutInfo& info, std::span<const std::byte> layout, int64_t slot,
                                    MoeW4a16Proj proj, int which = 0);

// The checkpoint bytes of one expert (the exact inverse of moe_w4a16_pack_expert): codes [n_out, n_in / 2] and E8M0
// scales [n_out, n_in / 32] of gate, up and down, each span exactly that size.
struct MoeW4a16ExpertBytes {
  std::span<std::byte> gate_codes, gate_scales, up_codes, up_scales, down_codes, down_scales;
};
// Gives back the bytes an expert's block was packed from, so a store that keeps experts only as blocks can still serve
// the checkpoint (checked against its XXH64 sums). Writes every byte of `out` (padding in the block is skipped).
// Throws on a wrong version or size, and on a block that cannot give the exact bytes back: a stored scale s' whose
// s = s' - 126 + scale_shift is outside 0..254, or s' = 0 under a shift (the packer clamped it: s is lost); `out` then
// holds partial data. Parallel over the block's stage blocks.
void moe_w4a16_unpack_expert(const MoeW4a16LayoutInfo& info, std::span<const std::byte> block,
                             const MoeW4a16ExpertBytes& out);

enum class MoeW4a16Act : uint8_t { kSwiGLU, kSiTU };

// Where the weighted combine runs (MoeW4a16Params::combine).
enum class MoeW4a16Combine : uint8_t { kAuto, kFused, kSeparate };

// The op's parameters, shared by the CPU reference and the CUDA launcher.
struct MoeW4a16Params {
  int64_t n_tokens = 0;  // 0 is valid (nothing runs)
  int64_t top_k = 0;     // slots per token; a token's expert ids are distinct (as top-k produces them)
  int64_t n_experts = 0; // local experts = layout slots
  int64_t hidden = 0;
  int64_t inter = 0;
  MoeW4a16Act act = MoeW4a16Act::kSwiGLU;
  float beta = 4.0f;        // SiTU only
  float beta_lin = 25.0f;   // SiTU only
  bool out_f32 = false;     // out dtype: fp32 or bf16
  bool accumulate = false;  // out[t] += ... (in fp32) instead of out[t] = ...
  // 0: split-K factor chosen on the device from the number of touched experts (fills the SMs); > 0: this factor
  // (capped at the k-stages), so a row's result does not depend on what else is in the batch (batch invariance).
  int32_t fixed_splits = 0;
  // CUDA only: launch the down kernel as a programmatic dependent of gate/up (its first weights stream while gate/up
  // finishes). Same results bit for bit (tested), and faster on the H200: 0.467 -> 0.491 of read at 1 row per expert,
  // 0.435 -> 0.458 at 4, 0.319 -> 0.325 at 16, equal at 32 (MoeW4a16Bench, bench/RESULTS.md 2026-12-02 13:02).
  bool pdl = true;
  // CUDA only: the tensor-core step on wgmma (sm_90a; A from registers, B the activations in a 128-byte-swizzle
  // tile) instead of mma.sync. The same arithmetic up to the order of the fp32 additions inside an MMA. Off by default:
  // slower than mma.sync below 32 rows per expert on the H200 (docs/MOE_W4A16.md); BG_MOE_W4A16_WGMMA=1 turns it on
  // where the backend builds the params.
  bool wgmma = false;
  // CUDA only: launches of at most 16 tokens on mma.sync (moe_w4a16_runs_narrow) run two CTAs per SM with 128
  // registers and 3 pipeline stages each, instead of one CTA with ~250 registers and 6 stages: twice the warps to hide
  // the decode's latency. The same arithmetic in the same order except the split-K factor, which is chosen for the
  // larger grid. A workspace is laid out for one shape: lay it out with the params it is launched with.
  // BG_MOE_W4A16_NARROW=0 turns it off where the backend builds the params.
  bool narrow = false;
  // Rows in, rows out (an expert-parallel rank, whose rows arrive through the exchange already grouped by slot): x is
  // [n_tokens * top_k, hidden] in the dispatch's row order (no gather), and out[row] = bf16(expert(x[row])), unweighted
  // (the exchange's combine applies the weights). n_tokens bounds the rows of one expert (the tokens of every rank);
  // out must be bf16 and accumulate false. Only the dispatch's offsets / active / n_active are read.
  bool rows_out = false;
  // CUDA only, narrow launches (moe_w4a16_runs_narrow: at most 16 tokens) without fixed_splits: stream-K, every
  // CTA an equal run of the launch's (item, k-stage) units, pass-tiles cut between CTAs finished by their last piece
  // in k order (moe_w4a16_schedule.h), instead of the split-K factor chosen per touched-expert count, whose pieces
  // leave one of an SM's two CTAs alone for the last wave (Kimi-K3 at one token: 384 gate/up half items and 224
  // down half items on 264 CTAs). Measured on the H100 (bench/RESULTS.md 2026-12-06): moe_decode_w4a16 0.145 ->
  // 0.128 ms at one token, 0.410 -> 0.389 at 16; not taken where it measured slower: the wide shape (0.433 -> 0.466 at
  // 16 tokens, whose 660 gate/up items already fill 5 waves of 132 CTAs) and 64 tokens (whole items, +10 %). Run to
  // run deterministic either way; BG_MOE_W4A16_STREAM_K=0 turns it off where the backend builds the params.
  bool stream_k = true;
  // The weighted combine (not with rows_out): kFused: the CTA that finishes a token's last slot sums its slots in the
  // down launch; kSeparate: down only writes y and a kernel after it (a programmatic dependent with pdl) combines
  // every (token, 512 columns), spread evenly over the GPU; kAuto: separate above kMoeW4a16FusedCombineMaxTokens
  // (moe_w4a16_separate_combine). The same fmas in the same order either way (the same bits).
  // BG_MOE_W4A16_COMBINE=auto|fused|separate sets it where the backend builds the params.
  MoeW4a16Combine combine = MoeW4a16Combine::kAuto;
  // CUDA only, where moe_w4a16_overlaps (wide launches of more than 32 tokens with pdl): down's CTAs do not wait for
  // the whole gate/up grid. gate/up releases a per-expert counter after each pass's h and lets down's grid launch at
  // once; a down CTA starts on an SM as soon as gate/up's CTA leaves it, takes its items by the order it started in
  // (moe_w4a16_schedule.h, overlap_head: the CTAs that start while gate/up's last wave runs take one item more) and
  // waits only for the experts of its items. gate/up's last wave (Kimi-K3 at 64 tokens: 12 of 672 items, 16 % of the
  // launch's SM time) then runs beside down's first items. The same arithmetic (the same bits); a stalled wait (2 s)
  // raises kMoeErrorOverlapStall. BG_MOE_W4A16_OVERLAP=0 turns it off where the backend builds the params.
  bool overlap = true;
};

// Throws naming the bad field.
void moe_w4a16_check_params(const MoeW4a16Params& p);

// Whether a launch combines in a kernel of its own after down (MoeW4a16Params::combine). Above 32 tokens almost every
// token completes in the last wave of down items, and the fused combine then loads the CTAs that finish them while
// others sit idle (Nsight Compute, H100, 64 tokens: SM active cycles 168 k .. 321 k, 260 k on average, bench/RESULTS.md
// 2026-12-06).
inline constexpr int64_t kMoeW4a16FusedCombineMaxTokens = 32;
bool moe_w4a16_separate_combine(const MoeW4a16Params& p);

// Whether a launch runs the narrow shape (CUDA; MoeW4a16Params::narrow asked for, mma.sync): at most 16 tokens, so
// every pass has at most 2 n8 blocks (the narrow kernel is compiled without 3- and 4-block passes, which spill at its
// 128 registers). Up to 2026-12-06 a second narrow kernel with 3- and 4-block passes ran 43-64 tokens; since the
// fused combine's rework the wide shape is faster there (H100, bench/RESULTS.md 2026-12-06: moe_decode_w4a16 at 64
// tokens 0.502-0.505 ms against 0.531-0.535, the slice's decode step 5.96 against 6.05-6.08 ms) and level at 17-40.
inline constexpr int64_t kMoeW4a16NarrowMaxTokens = 16;
bool moe_w4a16_runs_narrow(const MoeW4a16Params& p);

// Whether down overlaps gate/up's last wave (MoeW4a16Params::overlap): asked for, with pdl, on the wide shape, above
// 32 tokens (whole items, no parallel splits or stream-K, whose partial sums share counters between the launches).
bool moe_w4a16_overlaps(const MoeW4a16Params& p);

// Sizes of the kernel's workspace for p on `grid` persistent CTAs (the CUDA launcher lays the buffer out from it).
struct MoeW4a16WorkspaceGeometry {
  int32_t nb_cap = 1;           // n8 token blocks per pass: moe_w4a16_nb_cap
  bool stream = false;          // stream-K (MoeW4a16Params::stream_k: narrow, <= 32 tokens, no fixed splits)
  int64_t tile_counters = 0;    // split-K arrival counters: touched experts x items (stream-K: pass-tiles)
  int64_t token_counters = 0;   // combine counters: n_tokens x down items (0 with rows out)
  int64_t overlap_counters = 0; // moe_w4a16_overlaps: a ready counter per expert slot, then down's ticket and exit
                                // counters (n_experts + 2), else 0
  int64_t partial_slots = 0;    // split-K partial sums: the most any touched-expert count asks for, + per-CTA slots
                                // (stream-K: two per CTA)
  int64_t seq_slot_base = 0;    // first per-CTA running-sum slot (fixed splits, more tokens than one pass)
  int64_t slot_floats = 0;      // 4 tiles x nb_cap x 256 threads x 4
  int64_t rows = 0;             // n_tokens x top_k permuted rows (h, y)
  int32_t table_entries = 0;    // the most items one CTA takes (its item table in shared memory, 32 B each)
  int32_t prefix_entries = 0;   // stream-K: the pass-tile prefix in shared memory after the table (n_experts + 1)
};
MoeW4a16WorkspaceGeometry moe_w4a16_workspace_geometry(const MoeW4a16Params& p, int grid);

// CPU reference: out[t] = (accumulate ? out[t] : 0) + sum_k w[t,k] * down_e(h), h = bf16(GLU(gate_e x_t, up_e x_t)),
// e = ids[t,k], in slot order; dot products in double over the decoded weights (QuantWeight::decode_row), GLU in
// fp32, h rounded to bf16 exactly where the kernel stores it. x [n_tokens, hidden] (fp32 holding the bf16 inputs),
// ids / weights [n_tokens, top_k], out [n_tokens, hidden] fp32. experts: [n_experts].
void moe_w4a16_cpu(const MoeW4a16Params& p, std::span<const MoeW4a16ExpertView> experts, const float* x,
                   const int32_t* ids, const float* weights, float* out);

}  // namespace bg::ops

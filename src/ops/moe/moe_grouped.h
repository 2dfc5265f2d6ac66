// The dequantize-once prefill path of the expert FFN, host side (backend-neutral, no CUDA types): when to take it
// (rows per expert against a threshold), how many experts' bf16 weights one scratch holds, and the plan of a step —
// the touched experts in slot order, their rows, and the groups of experts processed one after another through the
// scratch. The device half (dequant, grouped GEMMs, GLU) is moe_grouped_cuda.h; design and numbers in docs/MOE_PREFILL.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace bg::ops {

// Expected rows per local expert (n_tokens * top_k / n_experts, as a balanced router gives) from which the grouped
// path runs instead of the tiled kernel. 32 is where the W4A16 decode kernel's range ends; below about 17 rows the
// dequant pass (~17 us per K3 expert) costs more than the tiled kernel saves (docs/MOE_PREFILL.md has the estimate;
// the bench case moe_prefill_grouped measures it). BG_MOE_GROUPED_MIN_ROWS overrides it.
inline constexpr int64_t kMoeGroupedMinRowsDefault = 32;
// The same threshold where the layer's MXFP4 experts have the fused W4A16 decode kernel (the alternative there): it
// runs any row count by further passes over the weights and measured 2.4x / 1.75x faster than the grouped path at 73 /
// 146 rows per expert on the H200 (K3 slice, eager steps; bench/RESULTS.md); by its pass count the grouped path wins
// from about 240. BG_MOE_GROUPED_MIN_ROWS overrides both.
inline constexpr int64_t kMoeGroupedMinRowsW4a16 = 192;
// Bytes of bf16 expert weights the scratch holds at most: the experts of a layer are processed in groups that fit.
// 1 GiB = 16 Kimi-K3 experts (66 MB each) or 12 DeepSeek-V3 experts (88 MB).
inline constexpr size_t kMoeGroupedScratchBudgetBytes = size_t{1} << 30;
// Experts per group at most (the dequant kernel takes the group's slots as a kernel parameter).
inline constexpr int64_t kMoeGroupedMaxGroupExperts = 64;

// The threshold from the value of BG_MOE_GROUPED_MIN_ROWS: null or empty -> kMoeGroupedMinRowsDefault; "off" -> 0
// (never); a positive integer -> that many rows. Anything else throws bg::Error naming the variable.
int64_t moe_grouped_min_rows(const char* env_value);
// Whether a layer call takes the grouped path: min_rows > 0 and n_tokens * top_k >= min_rows * n_experts.
bool moe_grouped_wanted(int64_t n_tokens, int64_t top_k, int64_t n_experts, int64_t min_rows);

// Which kernel runs the prefill-sized calls of a layer whose MXFP4 experts are held in the W4A16 layout, from
// BG_MOE_PREFILL (anything but the choices throws listing them):
// - "auto" (unset or empty): the W4A16 prefill kernel (ops/moe_w4a16/moe_w4a16_prefill_cuda.h: weights decoded in
//   registers, no bf16 copy, no host synchronisation) from kMoeW4a16PrefillMinRows rows per expert (or
//   BG_MOE_GROUPED_MIN_ROWS when set) up to kMoeW4a16PrefillMaxRows, the dequantize-once path from there, the fused
//   decode kernel below; under graph capture too (a captured decode step of 128 or more sequences), where the
//   dequantize-once path cannot run (the decode kernel takes its row counts);
// - "grouped": the dequantize-once path at the grouped threshold, the decode kernel below it;
// - "w4a16": the W4A16 prefill kernel at every row count from the lower bound;
// - "fp8" (opt-in, not exact: E4M3 activations, moe_fp8.h): the FP8 path from the lower bound at every row count, for
//   layers it supports (MXFP4 experts in the W4A16 layout, FP8-block experts); the others as "grouped".
// Layers without the W4A16 layout take the grouped path otherwise.
enum class MoePrefillKernel { kAuto, kGrouped, kW4a16, kFp8 };
// Measured on the H100 (bench/RESULTS.md, 2026-12-05, K3 experts): the prefill kernel against the fused decode kernel
// 0.82 / 1.14 ms at 36 rows per expert (0.67 / 0.57 at 18), against the dequantize-once path 3.52 / 4.22 ms at 292
// rows and 11.43 / 8.56 at 1170 (the times' ratio crosses 1 near 500 rows, by their log-log interpolation).
inline constexpr int64_t kMoeW4a16PrefillMinRows = 32;
inline constexpr int64_t kMoeW4a16PrefillMaxRows = 512;
MoePrefillKernel moe_prefill_kernel(const char* env_value);

// bf16 bytes of one expert in the scratch: gate|up [2 inter, hidden] then down [hidden, inter].
size_t moe_grouped_expert_bytes(int64_t hidden, int64_t inter);
// Experts per group for a scratch of `scratch_bytes`: min(kMoeGroupedMaxGroupExperts, scratch / expert bytes); 0
// when not even one fits.
int64_t moe_grouped_group_experts(int64_t hidden, int64_t inter, size_t scratch_bytes);

// Consecutive touched experts [first, first + n_experts) of the plan, whose rows are contiguous in the dispatch's
// permuted order: [row_begin, row_begin + n_rows).
struct MoeGroupedGroup {
  int32_t first = 0;
  int32_t n_experts = 0;
  int64_t row_begin = 0;
  int64_t n_rows = 0;
};

struct MoeGroupedPlan {
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t group_experts = 0;        // capacity of one group (what the weight scratch holds)
  std::vector<int32_t> slots;       // touched local slots, ascending (the dispatch's active list)
  std::vector<int32_t> rows;        // rows of each touched slot
  std::vector<int64_t> row_begin;   // first permuted row of each touched slot (the dispatch's offsets)
  std::vector<MoeGroupedGroup> groups;
  int64_t max_group_rows = 0;
  int64_t n_active() const { return static_cast<int64_t>(slots.size()); }
};

// The plan from the per-slot row counts of a dispatch (counts [n_slots], downloaded from the device): slots with rows
// in ascending order, offsets as the dispatch computes them (exclusive prefix sum), groups of at most group_experts.
// Throws for a negative count, a total above max_rows (the dispatch's n_pairs) or group_experts outside
// [1, kMoeGroupedMaxGroupExperts].
MoeGroupedPlan moe_grouped_plan(std::span<const int32_t> counts, int64_t hidden, int64_t inter, int64_t group_experts,
                                int64_t max_rows);

// Device bytes the plan needs beside the weight scratch: the gate|up outputs of the largest group (bf16
// [max_group_rows, 2 inter]) and the pointer arrays of the grouped GEMM calls (6 per touched expert).
size_t moe_grouped_gu_bytes(const MoeGroupedPlan& plan);
size_t moe_grouped_pointer_bytes(const MoeGroupedPlan& plan);

}  // namespace bg::ops

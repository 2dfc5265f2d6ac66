// The layout of one routed expert's weights as one contiguous block: its projections' parts (codes, then scales, in
// the architecture table's order: gate, up, down) each at a 256-byte aligned offset, the block rounded up to 4 KiB.
// The weight store lays every (layer, expert) out this way in host memory, and the CUDA upload lays a layer's experts
// out the same way in device memory, so one expert (or a layer's run of experts) moves with one DMA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace bg {

inline constexpr size_t kWeightPartAlign = 256;     // every tensor (part) starts at a multiple of this
inline constexpr size_t kWeightBlockAlign = 4096;   // every expert block and tensor group starts at a multiple of this

inline constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct ExpertBlockLayout {
  std::vector<size_t> part_offsets;  // bytes from the block start, one per part
  size_t bytes = 0;                  // the block's size, a multiple of kWeightBlockAlign
};

inline ExpertBlockLayout expert_block_layout(std::span<const size_t> part_bytes) {
  ExpertBlockLayout l;
  size_t cursor = 0;
  for (size_t b : part_bytes) {
    cursor = align_up(cursor, kWeightPartAlign);
    l.part_offsets.push_back(cursor);
    cursor += b;
  }
  l.bytes = align_up(cursor, kWeightBlockAlign);
  return l;
}

}  // namespace bg

// The store layout planner: tensors with their placements -> groups packed into segments (the manifest, checksums
// still zero). Each group is laid out by expert_block_layout (parts 256-byte aligned, the group 4 KiB aligned); a
// group never straddles two segments; segments are spread round-robin over NUMA nodes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weights/placement.h"
#include "weights/store_format.h"

namespace bg::weights {

struct PlannedTensor {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t bytes = 0;
  uint32_t source = 0;  // index into the sources passed to plan_layout
  TensorPlacement placement;
};

struct LayoutOptions {
  uint64_t segment_max_bytes = uint64_t{8} << 30;  // a larger group gets a segment of its own
  int n_numa_nodes = 1;                            // > 1: segment k is placed on node k % n
  // Expert groups that are one MXFP4 expert get room for its W4A16 block too (pack_expert_groups, after loading).
  bool w4a16_experts = false;
};

struct LayoutIdentity {
  std::string arch;
  uint64_t config_xxh64 = 0;
  uint64_t generation = 0;
};

Manifest plan_layout(std::vector<PlannedTensor> tensors, std::vector<std::string> sources, const LayoutOptions& o,
                     const LayoutIdentity& id);

}  // namespace bg::weights

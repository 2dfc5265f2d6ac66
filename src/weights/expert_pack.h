// Routed MXFP4 experts held as W4A16 blocks in a weight store (ExpertLayout::kW4a16, docs/WEIGHTS.md): recognising
// an expert group that can be packed, packing its loaded checkpoint bytes into the block the GPU kernel reads
// (ops/moe_w4a16, layout version kMoeW4a16LayoutVersion), and the exact unpack that gives the checkpoint tensors back
// (checked against their XXH64), for CPU engines and anything else that reads checkpoint tensors.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weights/segment.h"
#include "weights/store_format.h"

namespace bg::weights {

// One tensor of an expert group, as the plan or the manifest has it.
struct PartRef {
  const std::string* name = nullptr;
  DType dtype = DType::kU8;
  const Shape* shape = nullptr;
  uint64_t bytes = 0;
};

struct W4a16Geometry {
  int64_t hidden = 0;
  int64_t inter = 0;
  uint64_t block_bytes = 0;
};

// The W4A16 geometry of an expert group whose tensors (in plan order: gate, up, down, each codes then scales) are one
// MXFP4 expert: U8 codes [out, in/2] (`.weight_packed`) or [out, in/32, 16] (`.weight_blocks`), U8 scales [out, in/32]
// (`.weight_scale` / `.weight_scales`), gate and up [inter, hidden], down [hidden, inter]. nullopt otherwise (FP8, BF16
// experts, other groupings): such a group stays as stored.
std::optional<W4a16Geometry> w4a16_geometry(std::span<const PartRef> group);

// Packs one expert from its six checkpoint tensors' bytes (role order) into `block` (geometry.block_bytes). Returns
// false with `why` when the layout cannot hold it exactly (a scale above 2^1 would need the layer-wide scale shift, or
// a NaN scale 0xFF); the block is then untouched.
bool pack_w4a16_block(const W4a16Geometry& g, const std::array<std::span<const std::byte>, kPackedRoles>& parts,
                      std::span<std::byte> block, std::string* why);

// The six checkpoint tensors of a packed expert, from its block, each checked against its manifest XXH64 (a mismatch
// is an error naming the tensor and `what`: the block is corrupt).
void unpack_w4a16_block(const Manifest& m, const PackedExpert& pe, std::span<const std::byte> block,
                        const std::array<std::span<std::byte>, kPackedRoles>& out, const std::string& what);

struct PackReport {
  int64_t packed = 0;
  int64_t kept = 0;          // expert groups of the right shape left as stored (see pack_w4a16_block)
  std::string first_kept;    // why the first of them was kept
  double seconds = 0.0;
};

// After every tensor of `m` is in place with its checksum: packs each expert group w4a16_geometry accepts (its group
// was sized for the block by plan_layout), overwriting the group's start with the block and zeroing the rest, adds the
// block's tensor record (named w4a16_block_name) and marks the six parts packed. Sets m.expert_layout = kW4a16.
PackReport pack_expert_groups(Manifest& m, std::vector<MappedSegment>& segments);

// The tensor record name of the W4A16 block of (layer, expert); never a checkpoint tensor's name.
std::string w4a16_block_name(int64_t layer, int64_t expert);

}  // namespace bg::weights

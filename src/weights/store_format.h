// The weight store's format, layout version kStoreLayoutVersion (docs/WEIGHTS.md): a manifest segment (a 64-byte
// header, then the binary manifest) and data segments (a 4 KiB header page, then tensor groups: each (layer, expert)
// one contiguous 4 KiB-aligned block, the other tensors grouped by layer, every tensor 256-byte aligned). The same
// bytes live in POSIX shared memory (weightd) or in files (a checkpoint converted to the store layout). Little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "formats/expert_block.h"

namespace bg::weights {

// Bumped whenever the bytes of a segment or the manifest encoding change; a store of another version is never adopted.
// 2: tensor roles (MXFP4 experts held as W4A16 blocks), the expert layout and the W4A16 layout version.
inline constexpr uint32_t kStoreLayoutVersion = 2;
inline constexpr size_t kSegmentHeaderBytes = 4096;  // tensor data of a segment starts here
inline constexpr size_t kManifestHeaderBytes = 64;
inline constexpr int64_t kMaxStoreLayers = 1 << 16;
inline constexpr int64_t kMaxStoreExperts = 1 << 16;

enum class GroupKind : uint8_t { kGlobal = 0, kLayer = 1, kExpert = 2 };

enum class StoreState : uint32_t { kBuilding = 1, kReady = 2 };

// How routed experts are held (weightd start / batchgen convert --expert-layout). kW4a16: every MXFP4 expert whose
// scales the decode kernel's layout holds exactly (all real checkpoints) is one W4A16 block (ops/moe_w4a16), the bytes
// the GPU kernel reads, so an upload or a streamed expert is one copy with no re-layout; its checkpoint tensors are
// given back by an exact unpack. Other experts stay as stored.
enum class ExpertLayout : uint8_t { kCheckpoint = 0, kW4a16 = 1 };
std::string_view expert_layout_name(ExpertLayout l);
ExpertLayout parse_expert_layout(const std::string& s);  // "checkpoint" | "w4a16"; throws naming the choices

// What a tensor record is. kStored: its bytes are at (segment, offset). kW4a16Block: one expert's W4A16 block (U8
// [block bytes], at its group's start; not a checkpoint tensor, not listed by names()). The others: a checkpoint
// tensor held inside its group's block (offset = the group's; its xxh64 is of the checkpoint bytes an unpack gives).
enum class TensorRole : uint8_t {
  kStored = 0,
  kW4a16Block = 1,
  kGateCodes = 2,
  kGateScales = 3,
  kUpCodes = 4,
  kUpScales = 5,
  kDownCodes = 6,
  kDownScales = 7,
};
inline constexpr int kPackedRoles = 6;  // kGateCodes .. kDownScales, in this order in a packed group
inline bool is_packed_role(TensorRole r) { return r >= TensorRole::kGateCodes; }

// First bytes of the manifest segment. manifest_xxh64 covers the manifest bytes that follow the header.
struct ManifestHeader {
  char magic[8];  // "BGWSMANI"
  uint32_t layout_version = 0;
  uint32_t state = 0;  // StoreState
  uint64_t generation = 0;
  uint64_t manifest_bytes = 0;
  uint64_t manifest_xxh64 = 0;
  uint64_t n_segments = 0;
  uint64_t reserved[2] = {0, 0};
};
static_assert(sizeof(ManifestHeader) == kManifestHeaderBytes);

// First bytes of every data segment: ties it to its manifest (generation) and position.
struct SegmentHeader {
  char magic[8];  // "BGWSSEGM"
  uint32_t layout_version = 0;
  uint32_t index = 0;
  uint64_t generation = 0;
  uint64_t bytes = 0;  // the whole segment, header page included
};

struct SegmentInfo {
  uint64_t bytes = 0;      // whole segment incl. the header page
  int32_t numa_node = -1;  // where its pages were placed (-1: no NUMA policy)
};

struct GroupInfo {
  GroupKind kind = GroupKind::kGlobal;
  int64_t layer = -1;   // -1 for globals
  int64_t expert = -1;  // kExpert only
  uint32_t segment = 0;
  uint64_t offset = 0;  // bytes from the segment start, a multiple of 4 KiB
  uint64_t bytes = 0;   // a multiple of 4 KiB
};

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint32_t segment = 0;
  uint64_t offset = 0;  // bytes from the segment start, a multiple of 256
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;   // XXH64 (seed 0) of the tensor's bytes
  uint32_t source = 0;  // index into Manifest::sources
  uint32_t group = 0;   // index into Manifest::groups
  TensorRole role = TensorRole::kStored;
};

// A packed expert: its block tensor and the W4A16 geometry (from the packed tensors' shapes).
struct PackedExpert {
  uint32_t block = 0;  // index of the kW4a16Block tensor
  int64_t hidden = 0;
  int64_t inter = 0;
  uint32_t parts[kPackedRoles] = {};  // tensor indices, kGateCodes .. kDownScales
};

struct Manifest {
  uint64_t generation = 0;
  std::string arch;             // "deepseek_v3" | "kimi_k3"
  uint64_t config_xxh64 = 0;    // of the checkpoint's config.json: the model the store holds
  ExpertLayout expert_layout = ExpertLayout::kCheckpoint;  // what the builder was asked for
  uint32_t w4a16_version = 0;   // ops::kMoeW4a16LayoutVersion of the blocks (0: none packed)
  std::vector<std::string> sources;  // shard file names, or "peer:<node>" for tensors fetched from a peer
  std::vector<SegmentInfo> segments;
  std::vector<GroupInfo> groups;
  std::vector<TensorInfo> tensors;

  // Lookups built by index(): O(1) by name and by (layer, expert).
  std::unordered_map<std::string, uint32_t> by_name;
  std::vector<int32_t> expert_group;  // [layer * expert_stride + expert] -> group, -1 where none
  int64_t expert_stride = 0;
  std::unordered_map<uint32_t, PackedExpert> packed;  // group -> its packed expert

  // Tensors that are checkpoint tensors (every one but the W4A16 blocks).
  size_t n_checkpoint_tensors() const { return tensors.size() - packed.size(); }
  // The packed expert holding tensor `index`, or null when the tensor is stored as is.
  const PackedExpert* packed_of(uint32_t index) const;

  void index();
  // The group of (layer, expert)'s block, or -1.
  int32_t expert_block(int64_t layer, int64_t expert) const;
  uint64_t total_bytes() const;
};

std::vector<std::byte> encode_manifest(const Manifest& m);
// Decodes and validates everything (counts against the bytes left, names, dtypes, shapes against byte counts, every
// tensor inside its group and segment, groups inside their segments and disjoint, unique names and expert blocks,
// every packed group whole: one block of the W4A16 size of its six tensors' shapes, at the group's start).
// `what` names the source in errors. Throws bg::Error.
Manifest decode_manifest(std::span<const std::byte> bytes, const std::string& what);

ManifestHeader make_manifest_header(const Manifest& m, std::span<const std::byte> encoded, StoreState state);
SegmentHeader make_segment_header(const Manifest& m, uint32_t index);
// Checks magic, version and (for segments) index/generation/size; throws naming `what`.
void check_manifest_header(const ManifestHeader& h, uint64_t available_bytes, const std::string& what);
void check_segment_header(const SegmentHeader& h, const Manifest& m, uint32_t index, uint64_t mapped_bytes,
                          const std::string& what);

std::string_view group_kind_name(GroupKind kind);

}  // namespace bg::weights

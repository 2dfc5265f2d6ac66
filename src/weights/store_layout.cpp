// plan_layout: sort by (layer, kind, expert, table order), lay groups out, pack them into segments.
#include "weights/store_layout.h"

#include <algorithm>
#include <tuple>

#include "core/error.h"
#include "weights/expert_pack.h"

namespace bg::weights {
namespace {

// Globals first, then each layer: its non-expert group, then its expert blocks in expert order.
auto sort_key(const PlannedTensor& t) {
  const TensorPlacement& p = t.placement;
  return std::make_tuple(p.layer, p.kind == GroupKind::kExpert ? 1 : 0, p.expert, p.order, std::cref(t.name));
}

bool same_group(const TensorPlacement& a, const TensorPlacement& b) {
  return a.kind == b.kind && a.layer == b.layer && a.expert == b.expert;
}

}  // namespace

Manifest plan_layout(std::vector<PlannedTensor> tensors, std::vector<std::string> sources, const LayoutOptions& o,
                     const LayoutIdentity& id) {
  BG_CHECK(o.segment_max_bytes >= 2 * kSegmentHeaderBytes, "segment size {} is too small", o.segment_max_bytes);
  for (PlannedTensor& t : tensors) {
    // Layers past the format's bound (never in a real model) go to the global group rather than being refused.
    if (t.placement.layer >= kMaxStoreLayers || t.placement.expert >= kMaxStoreExperts) t.placement = {};
    BG_CHECK(t.source < sources.size(), "plan_layout: tensor '{}' has source {} of {}", t.name, t.source,
             sources.size());
  }
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return sort_key(a) < sort_key(b); });
  Manifest m;
  m.arch = id.arch;
  m.config_xxh64 = id.config_xxh64;
  m.generation = id.generation;
  m.sources = std::move(sources);
  uint64_t cursor = kSegmentHeaderBytes;
  auto close_segment = [&] {
    const int node = o.n_numa_nodes > 1 ? static_cast<int>(m.segments.size() % static_cast<size_t>(o.n_numa_nodes))
                                        : -1;
    m.segments.push_back({cursor, node});
    cursor = kSegmentHeaderBytes;
  };
  for (size_t begin = 0; begin < tensors.size();) {
    size_t end = begin + 1;
    while (end < tensors.size() && same_group(tensors[end].placement, tensors[begin].placement)) ++end;
    std::vector<size_t> part_bytes;
    for (size_t i = begin; i < end; ++i) part_bytes.push_back(tensors[i].bytes);
    const ExpertBlockLayout lay = expert_block_layout(part_bytes);
    uint64_t group_bytes = std::max<uint64_t>(lay.bytes, kWeightBlockAlign);
    if (o.w4a16_experts && tensors[begin].placement.kind == GroupKind::kExpert) {
      std::vector<PartRef> refs;
      for (size_t i = begin; i < end; ++i) {
        refs.push_back({&tensors[i].name, tensors[i].dtype, &tensors[i].shape, tensors[i].bytes});
      }
      if (const auto geo = w4a16_geometry(refs)) {
        group_bytes = std::max<uint64_t>(group_bytes, align_up(geo->block_bytes, kWeightBlockAlign));
      }
    }
    if (cursor > kSegmentHeaderBytes && cursor + group_bytes > o.segment_max_bytes) close_segment();
    GroupInfo g;
    g.kind = tensors[begin].placement.kind;
    g.layer = tensors[begin].placement.layer;
    g.expert = tensors[begin].placement.expert;
    g.segment = static_cast<uint32_t>(m.segments.size());
    g.offset = cursor;
    g.bytes = group_bytes;
    for (size_t i = begin; i < end; ++i) {
      TensorInfo t;
      t.name = std::move(tensors[i].name);
      t.dtype = tensors[i].dtype;
      t.shape = std::move(tensors[i].shape);
      t.segment = g.segment;
      t.offset = cursor + lay.part_offsets[i - begin];
      t.bytes = tensors[i].bytes;
      t.source = tensors[i].source;
      t.group = static_cast<uint32_t>(m.groups.size());
      m.tensors.push_back(std::move(t));
    }
    cursor += g.bytes;
    m.groups.push_back(g);
    begin = end;
  }
  if (cursor > kSegmentHeaderBytes || m.segments.empty()) close_segment();
  m.index();
  return m;
}

}  // namespace bg::weights

// W4A16 expert blocks in a weight store: geometry, pack after loading, exact unpack.
#include "weights/expert_pack.h"

#include <chrono>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "formats/quant.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "weights/checksum.h"

namespace bg::weights {
namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// [rows, cols] of an MXFP4 part from its codes (either naming) or scales tensor; {-1, -1} when it is not one.
std::pair<int64_t, int64_t> mxfp4_part_dims(const PartRef& p, bool codes) {
  const Shape& s = *p.shape;
  if (p.dtype != DType::kU8) return {-1, -1};
  if (codes && ends_with(*p.name, ".weight_packed") && s.size() == 2) return {s[0], s[1] * 2};
  if (codes && ends_with(*p.name, ".weight_blocks") && s.size() == 3 && s[2] == kMxfp4GroupSize / 2) {
    return {s[0], s[1] * kMxfp4GroupSize};
  }
  if (!codes && (ends_with(*p.name, ".weight_scale") || ends_with(*p.name, ".weight_scales")) && s.size() == 2) {
    return {s[0], s[1] * kMxfp4GroupSize};
  }
  return {-1, -1};
}

QuantWeight view(std::span<const std::byte> codes, std::span<const std::byte> scales, int64_t n_out, int64_t n_in) {
  QuantWeight q;
  q.format = WeightFormat::kMxfp4;
  q.n_out = n_out;
  q.n_in = n_in;
  q.data = {DType::kU8, {n_out, n_in / 2}, codes.data(), codes.size(), ""};
  q.scale = {DType::kU8, {n_out, n_in / kMxfp4GroupSize}, scales.data(), scales.size(), ""};
  return q;
}

}  // namespace

std::string w4a16_block_name(int64_t layer, int64_t expert) {
  return fmt::format("batchgen.w4a16_block.layer{}.expert{}", layer, expert);
}

std::optional<W4a16Geometry> w4a16_geometry(std::span<const PartRef> group) {
  if (group.size() != static_cast<size_t>(kPackedRoles)) return std::nullopt;
  std::pair<int64_t, int64_t> dims[kPackedRoles];
  for (int r = 0; r < kPackedRoles; ++r) {
    dims[r] = mxfp4_part_dims(group[static_cast<size_t>(r)], r % 2 == 0);
    if (dims[r].first <= 0 || dims[r].second <= 0) return std::nullopt;
    if (r % 2 == 1 && dims[r] != dims[r - 1]) return std::nullopt;
  }
  const int64_t inter = dims[0].first, hidden = dims[0].second;
  if (dims[2] != dims[0] || dims[4] != std::make_pair(hidden, inter)) return std::nullopt;
  if (hidden % kMxfp4GroupSize != 0 || inter % kMxfp4GroupSize != 0 || hidden > (1 << 20) || inter > (1 << 20)) {
    return std::nullopt;
  }
  for (int r = 0; r < kPackedRoles; ++r) {
    const auto [rows, cols] = dims[r];
    const auto want = static_cast<uint64_t>(rows * cols / (r % 2 == 0 ? 2 : kMxfp4GroupSize));
    if (group[static_cast<size_t>(r)].bytes != want) return std::nullopt;
  }
  const ops::MoeW4a16LayoutInfo info = ops::moe_w4a16_layout_info(1, hidden, inter);
  return W4a16Geometry{hidden, inter, static_cast<uint64_t>(info.block_bytes)};
}

bool pack_w4a16_block(const W4a16Geometry& g, const std::array<std::span<const std::byte>, kPackedRoles>& parts,
                      std::span<std::byte> block, std::string* why) {
  const QuantWeight gate = view(parts[0], parts[1], g.inter, g.hidden);
  const QuantWeight up = view(parts[2], parts[3], g.inter, g.hidden);
  const QuantWeight down = view(parts[4], parts[5], g.hidden, g.inter);
  const ops::MoeW4a16ExpertView ex{&gate, &up, &down};
  ops::MoeW4a16LayoutInfo info;
  try {
    info = ops::moe_w4a16_layer_info({&ex, 1}, g.hidden, g.inter);  // rejects NaN scales, finds the shifts it needs
  } catch (const Error& e) {
    *why = e.what();
    return false;
  }
  if (info.gate_up.scale_shift != 0 || info.down.scale_shift != 0) {
    // A shift is chosen per layer over all its experts; a block packed alone could not join a layer with another.
    *why = fmt::format("scales above 2^1 need a layer-wide scale shift ({} / {})", info.gate_up.scale_shift,
                       info.down.scale_shift);
    return false;
  }
  BG_CHECK(block.size() == static_cast<size_t>(info.block_bytes), "pack_w4a16_block: block of {} bytes, want {}",
           block.size(), info.block_bytes);
  ops::moe_w4a16_pack_expert(info, ex, 0, block);
  return true;
}

void unpack_w4a16_block(const Manifest& m, const PackedExpert& pe, std::span<const std::byte> block,
                        const std::array<std::span<std::byte>, kPackedRoles>& out, const std::string& what) {
  const ops::MoeW4a16LayoutInfo info = ops::moe_w4a16_layout_info(1, pe.hidden, pe.inter);
  ops::moe_w4a16_unpack_expert(info, block, {out[0], out[1], out[2], out[3], out[4], out[5]});
  for (int r = 0; r < kPackedRoles; ++r) {
    const TensorInfo& t = m.tensors[pe.parts[r]];
    BG_CHECK(xxh64(out[static_cast<size_t>(r)]) == t.xxh64, "{}: tensor '{}' unpacked from its W4A16 block does not "
             "match its checksum (the block '{}' is corrupt)", what, t.name, m.tensors[pe.block].name);
  }
}

PackReport pack_expert_groups(Manifest& m, std::vector<MappedSegment>& segments) {
  const auto t0 = std::chrono::steady_clock::now();
  PackReport rep;
  std::vector<std::vector<uint32_t>> members(m.groups.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) members[m.tensors[i].group].push_back(static_cast<uint32_t>(i));
  std::vector<std::byte> scratch;
  std::vector<TensorInfo> blocks;
  for (size_t gi = 0; gi < m.groups.size(); ++gi) {
    const GroupInfo& g = m.groups[gi];
    if (g.kind != GroupKind::kExpert || members[gi].size() != static_cast<size_t>(kPackedRoles)) continue;
    std::vector<PartRef> refs;
    for (uint32_t i : members[gi]) {
      const TensorInfo& t = m.tensors[i];
      if (t.role != TensorRole::kStored) break;
      refs.push_back({&t.name, t.dtype, &t.shape, t.bytes});
    }
    if (refs.size() != members[gi].size()) continue;
    const std::optional<W4a16Geometry> geo = w4a16_geometry(refs);
    if (!geo) continue;
    std::byte* base = segments.at(g.segment).data() + g.offset;
    if (geo->block_bytes > g.bytes) {  // a group planned without --expert-layout w4a16 (never from plan_layout)
      if (rep.kept++ == 0) rep.first_kept = fmt::format("group of {} bytes < block of {}", g.bytes, geo->block_bytes);
      continue;
    }
    std::array<std::span<const std::byte>, kPackedRoles> parts;
    for (int r = 0; r < kPackedRoles; ++r) {
      const TensorInfo& t = m.tensors[members[gi][static_cast<size_t>(r)]];
      parts[static_cast<size_t>(r)] = {segments[t.segment].data() + t.offset, t.bytes};
    }
    scratch.resize(geo->block_bytes);
    std::string why;
    if (!pack_w4a16_block(*geo, parts, scratch, &why)) {
      if (rep.kept++ == 0) rep.first_kept = fmt::format("layer {} expert {}: {}", g.layer, g.expert, why);
      continue;
    }
    // The block replaces the parts it was packed from (they overlap it): copied from the scratch, the rest zeroed.
    std::memcpy(base, scratch.data(), scratch.size());
    std::memset(base + scratch.size(), 0, g.bytes - scratch.size());
    for (int r = 0; r < kPackedRoles; ++r) {
      TensorInfo& t = m.tensors[members[gi][static_cast<size_t>(r)]];
      t.role = static_cast<TensorRole>(static_cast<int>(TensorRole::kGateCodes) + r);
      t.offset = g.offset;
    }
    TensorInfo b;
    b.name = w4a16_block_name(g.layer, g.expert);
    b.dtype = DType::kU8;
    b.shape = {static_cast<int64_t>(geo->block_bytes)};
    b.segment = g.segment;
    b.offset = g.offset;
    b.bytes = geo->block_bytes;
    b.xxh64 = xxh64(scratch);
    b.source = m.tensors[members[gi][0]].source;
    b.group = static_cast<uint32_t>(gi);
    b.role = TensorRole::kW4a16Block;
    blocks.push_back(std::move(b));
    ++rep.packed;
  }
  for (TensorInfo& b : blocks) m.tensors.push_back(std::move(b));
  m.expert_layout = ExpertLayout::kW4a16;
  m.w4a16_version = rep.packed > 0 ? ops::kMoeW4a16LayoutVersion : 0;
  m.index();
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace bg::weights

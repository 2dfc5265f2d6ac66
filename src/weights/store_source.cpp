// StoreSource / CompositeSource: manifest + mapped segments behind the WeightSource interface.
#include "weights/store_source.h"

#include <atomic>
#include <cstring>
#include <set>

#include "core/error.h"
#include "weights/checksum.h"
#include "weights/expert_pack.h"

namespace bg::weights {
namespace {

std::atomic<uint64_t> g_experts_unpacked{0};

}  // namespace

uint64_t StoreSource::experts_unpacked() { return g_experts_unpacked.load(); }

std::string store_segment_file(size_t index) { return fmt::format("store-seg-{:05d}.bin", index); }

bool is_store_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / kStoreManifestFile, ec);
}

Manifest read_manifest(std::span<const std::byte> bytes, const std::string& what) {
  BG_CHECK(bytes.size() >= kManifestHeaderBytes, "{}: {} bytes is too short for a manifest header", what,
           bytes.size());
  ManifestHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  check_manifest_header(h, bytes.size(), what);
  const auto body = bytes.subspan(kManifestHeaderBytes, h.manifest_bytes);
  BG_CHECK(xxh64(body) == h.manifest_xxh64, "{}: manifest checksum mismatch (the manifest is corrupt)", what);
  Manifest m = decode_manifest(body, what);
  BG_CHECK(m.generation == h.generation && m.segments.size() == h.n_segments,
           "{}: the header (generation {:#x}, {} segments) disagrees with the manifest (generation {:#x}, {} segments)",
           what, h.generation, h.n_segments, m.generation, m.segments.size());
  return m;
}

StoreSource::StoreSource(std::string describe, Manifest manifest, std::vector<MappedSegment> segments)
    : describe_(std::move(describe)), manifest_(std::move(manifest)), segments_(std::move(segments)) {
  BG_CHECK(segments_.size() == manifest_.segments.size(), "{}: {} segments mapped, the manifest lists {}", describe_,
           segments_.size(), manifest_.segments.size());
  for (size_t i = 0; i < segments_.size(); ++i) {
    const MappedSegment& s = segments_[i];
    BG_CHECK(s.bytes() >= sizeof(SegmentHeader), "{}: {} is too short", describe_, s.what());
    SegmentHeader h;
    std::memcpy(&h, s.data(), sizeof(h));
    check_segment_header(h, manifest_, static_cast<uint32_t>(i), s.bytes(), describe_ + ": " + s.what());
  }
}

std::shared_ptr<StoreSource> StoreSource::open_shm(const std::string& name, uint64_t expected_generation) {
  const std::string what = "weight store " + name;
  MappedSegment ms = MappedSegment::open_shm(shm_manifest_name(name), /*writable=*/false);
  Manifest m = read_manifest(std::span<const std::byte>(ms.data(), ms.bytes()), what + " manifest");
  BG_CHECK(expected_generation == 0 || m.generation == expected_generation,
           "{}: generation {:#x} in shared memory, weightd announced {:#x} (the store was replaced meanwhile)", what,
           m.generation, expected_generation);
  std::vector<MappedSegment> segs;
  for (size_t i = 0; i < m.segments.size(); ++i) {
    segs.push_back(MappedSegment::open_shm(shm_segment_name(name, i), /*writable=*/false));
  }
  return std::make_shared<StoreSource>(what, std::move(m), std::move(segs));
}

std::shared_ptr<StoreSource> StoreSource::open_dir(const std::filesystem::path& dir) {
  const std::string what = "store-layout checkpoint " + dir.string();
  MappedSegment mf = MappedSegment::open_file(dir / kStoreManifestFile, /*writable=*/false);
  Manifest m = read_manifest(std::span<const std::byte>(mf.data(), mf.bytes()), (dir / kStoreManifestFile).string());
  std::vector<MappedSegment> segs;
  for (size_t i = 0; i < m.segments.size(); ++i) {
    segs.push_back(MappedSegment::open_file(dir / store_segment_file(i), /*writable=*/false));
  }
  return std::make_shared<StoreSource>(what, std::move(m), std::move(segs));
}

std::span<const std::byte> StoreSource::tensor_bytes(uint32_t index) const {
  const TensorInfo& t = manifest_.tensors.at(index);
  return {segments_[t.segment].data() + t.offset, t.bytes};
}

bool StoreSource::contains(const std::string& name) const {
  auto it = manifest_.by_name.find(name);
  return it != manifest_.by_name.end() && manifest_.tensors[it->second].role != TensorRole::kW4a16Block;
}

std::optional<TensorView> StoreSource::find(const std::string& name) const {
  auto it = manifest_.by_name.find(name);
  if (it == manifest_.by_name.end()) return std::nullopt;
  const TensorInfo& t = manifest_.tensors[it->second];
  if (t.role == TensorRole::kW4a16Block) return std::nullopt;
  if (!is_packed_role(t.role)) {
    return TensorView{t.dtype, t.shape, segments_[t.segment].data() + t.offset, t.bytes, t.name};
  }
  const PackedExpert& pe = manifest_.packed.at(t.group);
  std::array<uint64_t, kPackedRoles + 1> offs{};
  for (int r = 0; r < kPackedRoles; ++r) {
    offs[static_cast<size_t>(r) + 1] = offs[static_cast<size_t>(r)] + manifest_.tensors[pe.parts[r]].bytes;
  }
  std::lock_guard lock(unpack_mu_);
  std::unique_ptr<std::byte[]>& parts = unpacked_[t.group];
  if (!parts) {
    auto buf = std::make_unique_for_overwrite<std::byte[]>(offs.back());
    std::array<std::span<std::byte>, kPackedRoles> out;
    for (size_t r = 0; r < out.size(); ++r) out[r] = {buf.get() + offs[r], offs[r + 1] - offs[r]};
    const TensorInfo& b = manifest_.tensors[pe.block];
    unpack_w4a16_block(manifest_, pe, {segments_[b.segment].data() + b.offset, b.bytes}, out, describe_);
    parts = std::move(buf);
    ++g_experts_unpacked;
  }
  const int r = static_cast<int>(t.role) - static_cast<int>(TensorRole::kGateCodes);
  return TensorView{t.dtype, t.shape, parts.get() + offs[static_cast<size_t>(r)], t.bytes, t.name};
}

std::optional<WeightSource::W4a16Block> StoreSource::w4a16_expert(int64_t layer, int64_t expert) const {
  const int32_t g = manifest_.expert_block(layer, expert);
  if (g < 0) return std::nullopt;
  auto it = manifest_.packed.find(static_cast<uint32_t>(g));
  if (it == manifest_.packed.end()) return std::nullopt;
  const TensorInfo& b = manifest_.tensors[it->second.block];
  return W4a16Block{{segments_[b.segment].data() + b.offset, b.bytes}, it->second.hidden, it->second.inter,
                    manifest_.w4a16_version};
}

std::string StoreSource::file_of(const std::string& name) const {
  auto it = manifest_.by_name.find(name);
  if (it == manifest_.by_name.end()) return "<none>";
  return fmt::format("{} (from {})", describe_, manifest_.sources[manifest_.tensors[it->second].source]);
}

std::vector<std::string> StoreSource::names() const {
  std::vector<std::string> out;
  out.reserve(manifest_.tensors.size());
  for (const TensorInfo& t : manifest_.tensors) {
    if (t.role != TensorRole::kW4a16Block) out.push_back(t.name);
  }
  return out;
}

std::vector<HostRegion> StoreSource::pinnable_regions() const {
  std::vector<HostRegion> out;
  for (const MappedSegment& s : segments_) out.push_back({s.data(), s.bytes()});
  return out;
}

std::span<const std::byte> StoreSource::expert_block(int64_t layer, int64_t expert) const {
  const int32_t g = manifest_.expert_block(layer, expert);
  if (g < 0) return {};
  const GroupInfo& gi = manifest_.groups[static_cast<size_t>(g)];
  return {segments_[gi.segment].data() + gi.offset, gi.bytes};
}

CompositeSource::CompositeSource(std::vector<std::shared_ptr<const WeightSource>> parts) : parts_(std::move(parts)) {}

std::string CompositeSource::describe() const {
  std::string out;
  for (const auto& p : parts_) out += (out.empty() ? "" : " + ") + p->describe();
  return out;
}

bool CompositeSource::contains(const std::string& name) const {
  for (const auto& p : parts_) {
    if (p->contains(name)) return true;
  }
  return false;
}

std::optional<TensorView> CompositeSource::find(const std::string& name) const {
  for (const auto& p : parts_) {
    if (auto v = p->find(name)) return v;
  }
  return std::nullopt;
}

std::string CompositeSource::file_of(const std::string& name) const {
  for (const auto& p : parts_) {
    if (p->contains(name)) return p->file_of(name);
  }
  return "<none>";
}

std::vector<std::string> CompositeSource::names() const {
  std::set<std::string> all;
  for (const auto& p : parts_) {
    for (auto& n : p->names()) all.insert(std::move(n));
  }
  return {all.begin(), all.end()};
}

std::optional<WeightSource::W4a16Block> CompositeSource::w4a16_expert(int64_t layer, int64_t expert) const {
  for (const auto& p : parts_) {
    if (auto b = p->w4a16_expert(layer, expert)) return b;
  }
  return std::nullopt;
}

std::vector<HostRegion> CompositeSource::pinnable_regions() const {
  std::vector<HostRegion> out;
  for (const auto& p : parts_) {
    for (const HostRegion& r : p->pinnable_regions()) out.push_back(r);
  }
  return out;
}

}  // namespace bg::weights

// Manifest encoding and its validating decoder; segment and manifest headers.
#include "weights/store_format.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "ops/moe_w4a16/moe_w4a16.h"
#include "weights/checksum.h"

namespace bg::weights {
namespace {

static_assert(std::endian::native == std::endian::little, "the store format is little-endian");

constexpr char kManifestMagic[8] = {'B', 'G', 'W', 'S', 'M', 'A', 'N', 'I'};
constexpr char kSegmentMagic[8] = {'B', 'G', 'W', 'S', 'S', 'E', 'G', 'M'};
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint32_t kMaxRank = 8;

class Writer {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    put(static_cast<uint32_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    out_.insert(out_.end(), p, p + s.size());
  }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

// Reads fields out of untrusted bytes: every read is bounds-checked, every count is checked against what is left.
class Reader {
 public:
  Reader(std::span<const std::byte> b, const std::string& what) : b_(b), what_(what) {}
  template <typename T>
  T get(const char* field) {
    BG_CHECK(b_.size() - pos_ >= sizeof(T), "{}: manifest truncated at {} (offset {})", what_, field, pos_);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(const char* field) {
    const auto n = get<uint32_t>(field);
    BG_CHECK(n <= kMaxNameBytes && n <= b_.size() - pos_, "{}: {} of {} bytes does not fit the manifest", what_, field,
             n);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), n);
    BG_CHECK(s.find('\0') == std::string::npos, "{}: {} contains a NUL byte", what_, field);
    pos_ += n;
    return s;
  }
  // A count of records of at least `min_record_bytes` each: bounded by the bytes left.
  uint32_t count(const char* field, size_t min_record_bytes) {
    const auto n = get<uint32_t>(field);
    BG_CHECK(static_cast<uint64_t>(n) * min_record_bytes <= b_.size() - pos_, "{}: {} = {} does not fit the manifest",
             what_, field, n);
    return n;
  }
  bool done() const { return pos_ == b_.size(); }

 private:
  std::span<const std::byte> b_;
  size_t pos_ = 0;
  const std::string& what_;
};

bool fits(uint64_t offset, uint64_t bytes, uint64_t limit) { return offset <= limit && bytes <= limit - offset; }

void validate_groups(const Manifest& m, const std::string& what) {
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> spans(m.segments.size());
  for (size_t i = 0; i < m.groups.size(); ++i) {
    const GroupInfo& g = m.groups[i];
    BG_CHECK(g.segment < m.segments.size(), "{}: group {} names segment {} of {}", what, i, g.segment,
             m.segments.size());
    BG_CHECK(g.offset >= kSegmentHeaderBytes && g.offset % kWeightBlockAlign == 0 &&
                 fits(g.offset, g.bytes, m.segments[g.segment].bytes),
             "{}: group {} [{}, +{}) is not an aligned range inside segment {} of {} bytes", what, i, g.offset,
             g.bytes, g.segment, m.segments[g.segment].bytes);
    BG_CHECK(g.layer >= -1 && g.layer < kMaxStoreLayers && g.expert >= -1 && g.expert < kMaxStoreExperts,
             "{}: group {} has layer {} expert {}", what, i, g.layer, g.expert);
    BG_CHECK((g.kind == GroupKind::kExpert) == (g.expert >= 0) && (g.kind == GroupKind::kGlobal) == (g.layer < 0),
             "{}: group {} ({}) has layer {} expert {}", what, i, group_kind_name(g.kind), g.layer, g.expert);
    spans[g.segment].emplace_back(g.offset, g.offset + g.bytes);
  }
  for (size_t s = 0; s < spans.size(); ++s) {
    std::sort(spans[s].begin(), spans[s].end());
    for (size_t i = 1; i < spans[s].size(); ++i) {
      BG_CHECK(spans[s][i].first >= spans[s][i - 1].second, "{}: groups overlap in segment {} at offset {}", what, s,
               spans[s][i].first);
    }
  }
}

void validate_tensor(const Manifest& m, const TensorInfo& t, const std::string& what) {
  const GroupInfo& g = m.groups.at(t.group);
  // A packed tensor's bytes are not stored (validate_packed checks it against its block); its offset is its group's.
  if (is_packed_role(t.role)) {
    BG_CHECK(t.segment == g.segment && t.offset == g.offset, "{}: packed tensor '{}' does not name its group's place",
             what, t.name);
    const uint64_t numel = static_cast<uint64_t>(shape_numel(t.shape));
    BG_CHECK(dtype_size_bytes(t.dtype) == 1 && numel == t.bytes, "{}: packed tensor '{}' is {} {}, not {} bytes", what,
             t.name, dtype_name(t.dtype), shape_str(t.shape), t.bytes);
    return;
  }
  BG_CHECK(t.segment == g.segment && t.offset % kWeightPartAlign == 0 && t.offset >= g.offset &&
               fits(t.offset - g.offset, t.bytes, g.bytes),
           "{}: tensor '{}' [{}, +{}) in segment {} lies outside its group {} [{}, +{}) in segment {}", what, t.name,
           t.offset, t.bytes, t.segment, t.group, g.offset, g.bytes, g.segment);
  const uint64_t numel = static_cast<uint64_t>(shape_numel(t.shape));
  BG_CHECK(numel <= std::numeric_limits<uint64_t>::max() / dtype_size_bytes(t.dtype) &&
               numel * dtype_size_bytes(t.dtype) == t.bytes,
           "{}: tensor '{}' holds {} bytes but {} {} needs {}", what, t.name, t.bytes, shape_str(t.shape),
           dtype_name(t.dtype), numel * dtype_size_bytes(t.dtype));
}

// A packed group holds exactly one block tensor at its start and the six checkpoint tensors of one MXFP4 expert (one
// per role), with shapes that agree (gate, up [inter, hidden]; down [hidden, inter]) and a block of their W4A16 size.
void validate_packed(const Manifest& m, const std::string& what) {
  std::unordered_map<uint32_t, std::vector<uint32_t>> by_group;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (m.tensors[i].role != TensorRole::kStored) by_group[m.tensors[i].group].push_back(static_cast<uint32_t>(i));
  }
  for (const TensorInfo& t : m.tensors) {
    BG_CHECK(t.role != TensorRole::kStored || by_group.count(t.group) == 0, "{}: tensor '{}' is stored inside packed "
             "group {}", what, t.name, t.group);
  }
  BG_CHECK(by_group.size() == m.packed.size(), "{}: {} groups hold packed tensors, {} of them have a W4A16 block",
           what, by_group.size(), m.packed.size());
  for (const auto& [gi, members] : by_group) {
    const GroupInfo& g = m.groups[gi];
    BG_CHECK(g.kind == GroupKind::kExpert && members.size() == 1 + kPackedRoles,
             "{}: group {} ({}) holds {} packed tensor records; a packed expert group holds its block and {} parts",
             what, gi, group_kind_name(g.kind), members.size(), kPackedRoles);
    const PackedExpert& pe = m.packed.at(gi);
    const TensorInfo& block = m.tensors[pe.block];
    BG_CHECK(block.offset == g.offset && block.dtype == DType::kU8 && block.shape.size() == 1,
             "{}: W4A16 block '{}' does not start its group {}", what, block.name, gi);
    uint32_t seen = 0;
    for (uint32_t i : members) seen |= 1u << static_cast<int>(m.tensors[i].role);
    BG_CHECK(seen == 0xfeu, "{}: packed group {} lacks a part or holds one twice", what, gi);
    const TensorInfo& gate = m.tensors[pe.parts[0]];
    const TensorInfo& down = m.tensors[pe.parts[4]];
    const int64_t inter = pe.inter, hidden = pe.hidden;
    BG_CHECK(hidden > 0 && inter > 0 && hidden <= (1 << 20) && inter <= (1 << 20) && hidden % 32 == 0 &&
                 inter % 32 == 0,
             "{}: packed expert of group {} ('{}', '{}') has hidden {} inter {}", what, gi, gate.name, down.name,
             hidden, inter);
    for (int r = 0; r < kPackedRoles; ++r) {
      const TensorInfo& t = m.tensors[pe.parts[r]];
      const int64_t rows = r < 4 ? inter : hidden, cols = r < 4 ? hidden : inter;
      const auto want = static_cast<uint64_t>(rows * cols / (r % 2 == 0 ? 2 : 32));
      BG_CHECK(!t.shape.empty() && t.shape[0] == rows && t.bytes == want, "{}: packed tensor '{}' is {} of {} bytes, "
               "an MXFP4 [{}, {}] part is {} rows of {} bytes", what, t.name, shape_str(t.shape), t.bytes, rows, cols,
               rows, want);
    }
    const auto want = static_cast<uint64_t>(ops::moe_w4a16_layout_info(1, hidden, inter).block_bytes);
    BG_CHECK(block.bytes == want && block.bytes <= g.bytes, "{}: W4A16 block '{}' of {} bytes, hidden {} inter {} "
             "needs {} (group of {})", what, block.name, block.bytes, hidden, inter, want, g.bytes);
    BG_CHECK(m.w4a16_version == ops::kMoeW4a16LayoutVersion, "{}: holds W4A16 blocks of layout version {}, this "
             "build reads version {}: remove the store and build it again", what, m.w4a16_version,
             ops::kMoeW4a16LayoutVersion);
  }
}

}  // namespace

std::string_view expert_layout_name(ExpertLayout l) { return l == ExpertLayout::kW4a16 ? "w4a16" : "checkpoint"; }

ExpertLayout parse_expert_layout(const std::string& s) {
  if (s == "checkpoint") return ExpertLayout::kCheckpoint;
  if (s == "w4a16") return ExpertLayout::kW4a16;
  fail("--expert-layout '{}': expected checkpoint or w4a16", s);
}

const PackedExpert* Manifest::packed_of(uint32_t index) const {
  if (index >= tensors.size() || tensors[index].role == TensorRole::kStored) return nullptr;
  auto it = packed.find(tensors[index].group);
  return it == packed.end() ? nullptr : &it->second;
}

std::string_view group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kGlobal: return "global";
    case GroupKind::kLayer: return "layer";
    case GroupKind::kExpert: return "expert";
  }
  return "?";
}

void Manifest::index() {
  by_name.clear();
  by_name.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) by_name.emplace(tensors[i].name, static_cast<uint32_t>(i));
  // Packed experts: the block, then the parts by role; hidden / inter from the down and gate codes' rows.
  packed.clear();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].role == TensorRole::kW4a16Block) packed[tensors[i].group].block = static_cast<uint32_t>(i);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    auto it = is_packed_role(t.role) ? packed.find(t.group) : packed.end();
    if (it == packed.end()) continue;
    const int r = static_cast<int>(t.role) - static_cast<int>(TensorRole::kGateCodes);
    it->second.parts[r] = static_cast<uint32_t>(i);
    if (t.role == TensorRole::kGateCodes && !t.shape.empty()) it->second.inter = t.shape[0];
    if (t.role == TensorRole::kDownCodes && !t.shape.empty()) it->second.hidden = t.shape[0];
  }
  int64_t max_layer = -1, max_expert = -1;
  for (const GroupInfo& g : groups) {
    if (g.kind != GroupKind::kExpert) continue;
    max_layer = std::max(max_layer, g.layer);
    max_expert = std::max(max_expert, g.expert);
  }
  expert_stride = max_expert + 1;
  expert_group.assign(static_cast<size_t>((max_layer + 1) * expert_stride), -1);
  for (size_t i = 0; i < groups.size(); ++i) {
    const GroupInfo& g = groups[i];
    if (g.kind == GroupKind::kExpert) {
      expert_group[static_cast<size_t>(g.layer * expert_stride + g.expert)] = static_cast<int32_t>(i);
    }
  }
}

int32_t Manifest::expert_block(int64_t layer, int64_t expert) const {
  if (layer < 0 || expert < 0 || expert >= expert_stride) return -1;
  const auto i = static_cast<size_t>(layer * expert_stride + expert);
  return i < expert_group.size() ? expert_group[i] : -1;
}

uint64_t Manifest::total_bytes() const {
  uint64_t total = 0;
  for (const SegmentInfo& s : segments) total += s.bytes;
  return total;
}

std::vector<std::byte> encode_manifest(const Manifest& m) {
  Writer w;
  w.put(m.generation);
  w.str(m.arch);
  w.put(m.config_xxh64);
  w.put(static_cast<uint8_t>(m.expert_layout));
  w.put(m.w4a16_version);
  w.put(static_cast<uint32_t>(m.sources.size()));
  for (const auto& s : m.sources) w.str(s);
  w.put(static_cast<uint32_t>(m.segments.size()));
  for (const auto& s : m.segments) {
    w.put(s.bytes);
    w.put(s.numa_node);
  }
  w.put(static_cast<uint32_t>(m.groups.size()));
  for (const auto& g : m.groups) {
    w.put(static_cast<uint8_t>(g.kind));
    w.put(g.layer);
    w.put(g.expert);
    w.put(g.segment);
    w.put(g.offset);
    w.put(g.bytes);
  }
  w.put(static_cast<uint32_t>(m.tensors.size()));
  for (const auto& t : m.tensors) {
    w.str(t.name);
    w.put(static_cast<uint8_t>(t.dtype));
    w.put(static_cast<uint8_t>(t.shape.size()));
    for (int64_t d : t.shape) w.put(d);
    w.put(t.segment);
    w.put(t.offset);
    w.put(t.bytes);
    w.put(t.xxh64);
    w.put(t.source);
    w.put(t.group);
    w.put(static_cast<uint8_t>(t.role));
  }
  return w.take();
}

Manifest decode_manifest(std::span<const std::byte> bytes, const std::string& what) {
  Reader r(bytes, what);
  Manifest m;
  m.generation = r.get<uint64_t>("generation");
  m.arch = r.str("arch");
  m.config_xxh64 = r.get<uint64_t>("config hash");
  const auto layout = r.get<uint8_t>("expert layout");
  BG_CHECK(layout <= static_cast<uint8_t>(ExpertLayout::kW4a16), "{}: unknown expert layout {}", what, layout);
  m.expert_layout = static_cast<ExpertLayout>(layout);
  m.w4a16_version = r.get<uint32_t>("W4A16 layout version");
  for (uint32_t i = 0, n = r.count("source count", 4); i < n; ++i) m.sources.push_back(r.str("source name"));
  for (uint32_t i = 0, n = r.count("segment count", 12); i < n; ++i) {
    SegmentInfo s;
    s.bytes = r.get<uint64_t>("segment bytes");
    s.numa_node = r.get<int32_t>("segment numa node");
    BG_CHECK(s.bytes >= kSegmentHeaderBytes, "{}: segment {} of {} bytes is smaller than its header", what, i,
             s.bytes);
    m.segments.push_back(s);
  }
  for (uint32_t i = 0, n = r.count("group count", 37); i < n; ++i) {
    GroupInfo g;
    const auto kind = r.get<uint8_t>("group kind");
    BG_CHECK(kind <= static_cast<uint8_t>(GroupKind::kExpert), "{}: group {} has unknown kind {}", what, i, kind);
    g.kind = static_cast<GroupKind>(kind);
    g.layer = r.get<int64_t>("group layer");
    g.expert = r.get<int64_t>("group expert");
    g.segment = r.get<uint32_t>("group segment");
    g.offset = r.get<uint64_t>("group offset");
    g.bytes = r.get<uint64_t>("group bytes");
    m.groups.push_back(g);
  }
  validate_groups(m, what);
  for (uint32_t i = 0, n = r.count("tensor count", 43); i < n; ++i) {
    TensorInfo t;
    t.name = r.str("tensor name");
    BG_CHECK(!t.name.empty(), "{}: tensor {} has an empty name", what, i);
    const auto dtype = r.get<uint8_t>("tensor dtype");
    BG_CHECK(dtype <= static_cast<uint8_t>(DType::kU64), "{}: tensor '{}' has unknown dtype {}", what, t.name, dtype);
    t.dtype = static_cast<DType>(dtype);
    const auto rank = r.get<uint8_t>("tensor rank");
    BG_CHECK(rank <= kMaxRank, "{}: tensor '{}' has rank {}", what, t.name, rank);
    for (uint8_t d = 0; d < rank; ++d) {
      const auto dim = r.get<int64_t>("tensor dim");
      BG_CHECK(dim >= 0 && dim < (int64_t{1} << 40), "{}: tensor '{}' has dimension {}", what, t.name, dim);
      t.shape.push_back(dim);
    }
    t.segment = r.get<uint32_t>("tensor segment");
    t.offset = r.get<uint64_t>("tensor offset");
    t.bytes = r.get<uint64_t>("tensor bytes");
    t.xxh64 = r.get<uint64_t>("tensor checksum");
    t.source = r.get<uint32_t>("tensor source");
    t.group = r.get<uint32_t>("tensor group");
    const auto role = r.get<uint8_t>("tensor role");
    BG_CHECK(role <= static_cast<uint8_t>(TensorRole::kDownScales), "{}: tensor '{}' has unknown role {}", what,
             t.name, role);
    t.role = static_cast<TensorRole>(role);
    BG_CHECK(t.group < m.groups.size() && t.source < m.sources.size(),
             "{}: tensor '{}' names group {} of {} / source {} of {}", what, t.name, t.group, m.groups.size(),
             t.source, m.sources.size());
    validate_tensor(m, t, what);
    m.tensors.push_back(std::move(t));
  }
  BG_CHECK(r.done(), "{}: bytes left after the manifest", what);
  m.index();
  BG_CHECK(m.by_name.size() == m.tensors.size(), "{}: a tensor name appears twice", what);
  size_t n_expert_groups = 0;
  for (const GroupInfo& g : m.groups) n_expert_groups += g.kind == GroupKind::kExpert;
  size_t n_indexed = 0;
  for (int32_t gi : m.expert_group) n_indexed += gi >= 0;
  BG_CHECK(n_indexed == n_expert_groups, "{}: an expert block (layer, expert) appears twice", what);
  validate_packed(m, what);
  return m;
}

ManifestHeader make_manifest_header(const Manifest& m, std::span<const std::byte> encoded, StoreState state) {
  ManifestHeader h;
  std::memcpy(h.magic, kManifestMagic, sizeof(h.magic));
  h.layout_version = kStoreLayoutVersion;
  h.state = static_cast<uint32_t>(state);
  h.generation = m.generation;
  h.manifest_bytes = encoded.size();
  h.manifest_xxh64 = xxh64(encoded);
  h.n_segments = m.segments.size();
  return h;
}

SegmentHeader make_segment_header(const Manifest& m, uint32_t index) {
  SegmentHeader h;
  std::memcpy(h.magic, kSegmentMagic, sizeof(h.magic));
  h.layout_version = kStoreLayoutVersion;
  h.index = index;
  h.generation = m.generation;
  h.bytes = m.segments.at(index).bytes;
  return h;
}

void check_manifest_header(const ManifestHeader& h, uint64_t available_bytes, const std::string& what) {
  BG_CHECK(std::memcmp(h.magic, kManifestMagic, sizeof(h.magic)) == 0, "{}: not a weight-store manifest (bad magic)",
           what);
  BG_CHECK(h.layout_version == kStoreLayoutVersion, "{}: layout version {} (this build reads version {})", what,
           h.layout_version, kStoreLayoutVersion);
  BG_CHECK(h.state == static_cast<uint32_t>(StoreState::kReady),
           "{}: the store was never completed (its loader stopped before the end)", what);
  BG_CHECK(h.manifest_bytes <= available_bytes - kManifestHeaderBytes, "{}: manifest of {} bytes runs past the {} "
           "bytes available", what, h.manifest_bytes, available_bytes);
}

void check_segment_header(const SegmentHeader& h, const Manifest& m, uint32_t index, uint64_t mapped_bytes,
                          const std::string& what) {
  BG_CHECK(std::memcmp(h.magic, kSegmentMagic, sizeof(h.magic)) == 0 && h.layout_version == kStoreLayoutVersion,
           "{}: not a weight-store segment of layout version {}", what, kStoreLayoutVersion);
  BG_CHECK(h.index == index && h.generation == m.generation,
           "{}: segment {} of store generation {:#x}, but the manifest expects segment {} of generation {:#x}", what,
           h.index, h.generation, index, m.generation);
  BG_CHECK(h.bytes == m.segments.at(index).bytes && mapped_bytes == h.bytes,
           "{}: {} bytes (header says {}), the manifest expects {}", what, mapped_bytes, h.bytes,
           m.segments.at(index).bytes);
}

}  // namespace bg::weights

// scan_model, StoreTarget and build_store: from a model directory to a complete store (shm or files).
#include "weights/store_builder.h"

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <map>
#include <fstream>
#include <random>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "weights/expert_pack.h"
#include "weights/progress.h"
#include "weights/store_source.h"

namespace bg::weights {
namespace {

namespace fs = std::filesystem;

StoreInput scan_store_dir(const fs::path& dir) {
  StoreInput in;
  in.model_dir = dir;
  MappedSegment mf = MappedSegment::open_file(dir / kStoreManifestFile, /*writable=*/false);
  Manifest m = read_manifest(std::span<const std::byte>(mf.data(), mf.bytes()), (dir / kStoreManifestFile).string());
  in.arch = m.arch;
  in.config_xxh64 = config_checksum(dir);
  BG_CHECK(in.config_xxh64 == m.config_xxh64, "{}: config.json differs from the one the store layout was built from",
           dir.string());
  in.sources = m.sources;
  for (size_t i = 0; i < m.segments.size(); ++i) in.files.push_back(dir / store_segment_file(i));
  for (const TensorInfo& t : m.tensors) {
    const GroupInfo& g = m.groups[t.group];
    // The checkpoint's tensors (what a store of it must hold); the bytes read are the stored records' (a W4A16 block
    // holds its packed parts).
    if (t.role != TensorRole::kW4a16Block) {
      in.tensors.push_back({t.name, t.dtype, t.shape, t.bytes, t.source, {g.kind, g.layer, g.expert, 0}});
    }
    if (!is_packed_role(t.role)) in.ranges[t.name] = {t.segment, t.offset};
  }
  in.prebuilt = std::move(m);
  return in;
}

// The shards of a node's share: each must be listed by the index, and each of its tensors mapped to it.
std::vector<std::unique_ptr<SafetensorsFile>> open_shards(const fs::path& dir, const std::vector<std::string>& shards) {
  const fs::path index_path = dir / "model.safetensors.index.json";
  const auto index = read_json_file(index_path);
  BG_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
           "{}: missing object 'weight_map'", index_path.string());
  std::map<std::string, std::string> mapped;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    BG_CHECK(shard.is_string(), "{}: weight_map['{}'] is not a string", index_path.string(), name);
    mapped[name] = shard.get<std::string>();
  }
  std::set<std::string> listed;
  for (const auto& [name, shard] : mapped) listed.insert(shard);
  std::vector<std::unique_ptr<SafetensorsFile>> out;
  for (const std::string& shard : shards) {
    BG_CHECK(listed.count(shard) != 0, "{}: shard '{}' of this node is not in the index", index_path.string(), shard);
    out.push_back(SafetensorsFile::open(dir / shard));
    for (const auto& e : out.back()->header().entries) {
      auto it = mapped.find(e.name);
      BG_CHECK(it != mapped.end() && it->second == shard, "{}: tensor '{}' is not mapped to {} by the index",
               (dir / shard).string(), e.name, shard);
    }
  }
  return out;
}

void write_all(const fs::path& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  BG_CHECK(out.good(), "cannot create '{}'", path.string());
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  BG_CHECK(out.good(), "write to '{}' failed", path.string());
}

std::vector<std::byte> manifest_image(const Manifest& m, StoreState state) {
  const std::vector<std::byte> body = encode_manifest(m);
  const ManifestHeader h = make_manifest_header(m, body, state);
  std::vector<std::byte> image(kManifestHeaderBytes + body.size());
  std::memcpy(image.data(), &h, sizeof(h));
  std::memcpy(image.data() + kManifestHeaderBytes, body.data(), body.size());
  return image;
}

}  // namespace

StoreInput scan_model(const fs::path& dir, const std::vector<std::string>* only_shards) {
  if (is_store_dir(dir)) {
    BG_CHECK(only_shards == nullptr, "{}: a store-layout checkpoint is loaded whole, not by shards", dir.string());
    return scan_store_dir(dir);
  }
  StoreInput in;
  in.model_dir = dir;
  const Placement placement = Placement::for_model(dir);
  in.arch = placement.arch();
  in.config_xxh64 = placement.config_xxh64();
  std::unique_ptr<Checkpoint> ckpt;
  std::vector<std::unique_ptr<SafetensorsFile>> shards;
  if (only_shards != nullptr) {
    shards = open_shards(dir, *only_shards);
  } else {
    ckpt = Checkpoint::open(dir);
  }
  const auto& files = only_shards != nullptr ? shards : ckpt->files();
  for (size_t fi = 0; fi < files.size(); ++fi) {
    in.files.push_back(files[fi]->path());
    in.sources.push_back(files[fi]->path().filename().string());
    for (const SafetensorsEntry& e : files[fi]->header().entries) {
      in.tensors.push_back({e.name, e.dtype, e.shape, e.nbytes, static_cast<uint32_t>(fi), placement.classify(e.name)});
      in.ranges[e.name] = {static_cast<uint32_t>(fi), e.file_offset};
    }
  }
  return in;
}

StoreTarget StoreTarget::shm(std::string store_name) {
  check_store_name(store_name);
  StoreTarget t;
  t.store_name_ = std::move(store_name);
  return t;
}

StoreTarget StoreTarget::dir(fs::path dir) {
  StoreTarget t;
  t.dir_ = std::move(dir);
  return t;
}

std::string StoreTarget::describe() const {
  return is_shm() ? "weight store " + store_name_ : "store-layout directory " + dir_.string();
}

std::vector<MappedSegment> StoreTarget::create(const Manifest& m) const {
  if (is_shm()) {
    const uint64_t need = m.total_bytes();
    BG_CHECK(need <= shm_free_bytes(), "{}: needs {} of shared memory, /dev/shm has {} free (its size is a mount "
             "option: mount -o remount,size=...)", describe(), need, shm_free_bytes());
    const std::vector<std::byte> image = manifest_image(m, StoreState::kBuilding);
    MappedSegment ms = MappedSegment::create_shm(shm_manifest_name(store_name_), image.size(), -1);
    std::memcpy(ms.data(), image.data(), image.size());
  }
  std::vector<MappedSegment> segs;
  for (size_t i = 0; i < m.segments.size(); ++i) {
    const SegmentInfo& si = m.segments[i];
    segs.push_back(is_shm() ? MappedSegment::create_shm(shm_segment_name(store_name_, i), si.bytes, si.numa_node)
                            : MappedSegment::create_file(dir_ / store_segment_file(i), si.bytes));
    const SegmentHeader h = make_segment_header(m, static_cast<uint32_t>(i));
    std::memcpy(segs.back().data(), &h, sizeof(h));
  }
  return segs;
}

void StoreTarget::finish(const Manifest& m) const {
  const std::vector<std::byte> image = manifest_image(m, StoreState::kReady);
  if (!is_shm()) {
    // Written under a temporary name and renamed: a directory with store.manifest is always complete.
    const fs::path tmp = dir_ / (std::string(kStoreManifestFile) + ".tmp");
    write_all(tmp, image);
    fs::rename(tmp, dir_ / kStoreManifestFile);
    return;
  }
  MappedSegment ms = MappedSegment::open_shm(shm_manifest_name(store_name_), /*writable=*/true);
  if (ms.bytes() != image.size()) {
    // The manifest grew after the plan (W4A16 block records): a new segment, whose zero header reads as "not a
    // manifest" until the header below is written.
    ms = MappedSegment();
    ::shm_unlink(shm_manifest_name(store_name_).c_str());
    ms = MappedSegment::create_shm(shm_manifest_name(store_name_), image.size(), -1);
  }
  // Body first, the header (state kReady) last: a reader never sees "ready" over a half-written manifest.
  std::memcpy(ms.data() + kManifestHeaderBytes, image.data() + kManifestHeaderBytes, image.size() - kManifestHeaderBytes);
  std::atomic_thread_fence(std::memory_order_release);
  std::memcpy(ms.data(), image.data(), kManifestHeaderBytes);
}

void StoreTarget::remove() const {
  if (is_shm()) {
    remove_store_shm(store_name_);
    return;
  }
  std::error_code ec;
  fs::remove(dir_ / kStoreManifestFile, ec);
  for (size_t i = 0; fs::exists(dir_ / store_segment_file(i), ec); ++i) fs::remove(dir_ / store_segment_file(i), ec);
}

uint64_t new_generation() {
  std::random_device rd;
  uint64_t g = 0;
  while (g == 0) g = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return g;
}

BuiltStore build_store(const StoreInput& in, const StoreTarget& target, const BuildOptions& o,
                       const std::vector<PlannedTensor>& extra) {
  BuiltStore b;
  if (in.prebuilt) {
    BG_CHECK(extra.empty(), "{}: a store-layout checkpoint is loaded whole", in.model_dir.string());
    b.manifest = *in.prebuilt;
    b.manifest.generation = new_generation();
  } else {
    BG_CHECK(extra.empty() || o.expert_layout == ExpertLayout::kCheckpoint, "--expert-layout w4a16 is not supported "
             "with tensors fetched from peers yet (a distributed store holds experts as in the checkpoint)");
    std::vector<PlannedTensor> all = in.tensors;
    std::vector<std::string> sources = in.sources;
    for (const PlannedTensor& t : extra) all.push_back(t);
    LayoutOptions lo = o.layout;
    lo.w4a16_experts = o.expert_layout == ExpertLayout::kW4a16;
    b.manifest = plan_layout(std::move(all), std::move(sources), lo, {in.arch, in.config_xxh64, new_generation()});
  }
  try {
    b.segments = target.create(b.manifest);
    std::vector<CopyJob> jobs;
    std::vector<LoadProgress::File> files;
    for (const fs::path& f : in.files) files.push_back({f.filename().string(), 0});
    for (size_t i = 0; i < b.manifest.tensors.size(); ++i) {
      const TensorInfo& t = b.manifest.tensors[i];
      auto it = in.ranges.find(t.name);
      if (it == in.ranges.end()) continue;  // an extra tensor, fetched later
      jobs.push_back({it->second.file, it->second.offset, t.bytes, b.segments[t.segment].data() + t.offset,
                      static_cast<uint32_t>(i)});
      files[it->second.file].total_bytes += t.bytes;
    }
    LoadProgress progress("loading " + in.model_dir.string() + " into the " + target.describe(), files,
                          {.tty = o.progress_tty});
    ReadOptions ro = o.read;
    ro.progress = &progress;
    progress.start();
    if (o.on_progress) o.on_progress(&progress);
    ReadResult r;
    try {
      r = read_into(in.files, std::move(jobs), b.manifest.tensors.size(), ro);
    } catch (...) {
      if (o.on_progress) o.on_progress(nullptr);
      throw;
    }
    if (o.on_progress) o.on_progress(nullptr);
    progress.finish();
    for (size_t i = 0; i < b.manifest.tensors.size(); ++i) {
      TensorInfo& t = b.manifest.tensors[i];
      if (!in.ranges.count(t.name)) continue;
      if (in.prebuilt) {
        BG_CHECK(r.checksums[i] == t.xxh64, "{}: tensor '{}' in {} does not match its checksum (the file is corrupt)",
                 in.model_dir.string(), t.name, store_segment_file(t.segment));
      }
      t.xxh64 = r.checksums[i];
    }
    b.report.bytes = r.bytes;
    b.report.seconds = r.seconds;
    b.report.reader = r.reader;
    if (!in.prebuilt && o.expert_layout == ExpertLayout::kW4a16) {
      const PackReport pr = pack_expert_groups(b.manifest, b.segments);
      b.report.w4a16_packed = pr.packed;
      b.report.w4a16_kept = pr.kept;
      b.report.w4a16_first_kept = pr.first_kept;
      b.report.pack_seconds = pr.seconds;
      log::info("{}: {} experts packed into W4A16 blocks in {:.2f} s", target.describe(), pr.packed, pr.seconds);
      if (pr.kept > 0) {
        log::warn("{}: {} MXFP4 experts kept as stored (first: {})", target.describe(), pr.kept, pr.first_kept);
      }
    }
    if (extra.empty()) target.finish(b.manifest);
  } catch (...) {
    b.segments.clear();
    target.remove();
    throw;
  }
  return b;
}

}  // namespace bg::weights

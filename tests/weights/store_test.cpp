// The fast reader (io_uring and pread, checksums on the way), building a store in shared memory and in files, attaching
// to it, verification, repair and the refusals of adoption.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <random>

#include "formats/checkpoint.h"
#include "model/model_testing.h"
#include "weights/checksum.h"
#include "weights/file_reader.h"
#include "weights/store_builder.h"
#include "weights/store_source.h"
#include "store_checks.h"
#include "weights_testing.h"

namespace bg::testing {
namespace {

using namespace bg::weights;

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

TEST(FileReader, CopiesRangesAndHashesThemWithEveryReader) {
  TempDir tmp;
  const auto a = random_bytes(300'001, 1), b = random_bytes(77'777, 2);
  std::ofstream(tmp / "a", std::ios::binary).write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(a.size()));
  std::ofstream(tmp / "b", std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  // Ranges with odd offsets and sizes, spanning chunk boundaries, one of them empty, one at the very end.
  struct R {
    uint32_t file;
    uint64_t off, len;
  };
  const std::vector<R> ranges = {{0, 0, 5000}, {0, 5000, 123'457}, {0, 200'000, 0}, {0, 250'000, 50'001},
                                 {1, 13, 77'764}, {1, 0, 13}};
  std::vector<ReaderKind> kinds = {ReaderKind::kPread};
  if (io_uring_available()) kinds.push_back(ReaderKind::kUring);
  for (ReaderKind kind : kinds) {
    for (bool direct : {false, true}) {
      std::vector<std::vector<std::byte>> dst;
      std::vector<CopyJob> jobs;
      for (size_t i = 0; i < ranges.size(); ++i) dst.emplace_back(ranges[i].len + 1, std::byte{0x5a});
      for (size_t i = 0; i < ranges.size(); ++i) {
        jobs.push_back({ranges[i].file, ranges[i].off, ranges[i].len, dst[i].data(), static_cast<uint32_t>(i)});
      }
      ReadOptions o;
      o.kind = kind;
      o.direct = direct;
      o.chunk_bytes = 3 * 4096;
      o.n_threads = 3;
      const ReadResult r = read_into({tmp / "a", tmp / "b"}, jobs, ranges.size(), o);
      for (size_t i = 0; i < ranges.size(); ++i) {
        const auto& src = ranges[i].file == 0 ? a : b;
        std::span<const std::byte> want(src.data() + ranges[i].off, ranges[i].len);
        EXPECT_EQ(std::memcmp(dst[i].data(), want.data(), want.size()), 0) << r.reader << " range " << i;
        EXPECT_EQ(dst[i].back(), std::byte{0x5a}) << "wrote past the range " << i;
        EXPECT_EQ(r.checksums[i], xxh64(want)) << r.reader << " range " << i;
      }
      EXPECT_EQ(r.bytes, 5000u + 123'457 + 50'001 + 77'764 + 13);
    }
  }
}

TEST(FileReader, RangesPastTheEndOrOverlappingAreErrors) {
  TempDir tmp;
  std::ofstream(tmp / "a", std::ios::binary) << std::string(1000, 'x');
  std::vector<std::byte> dst(2000);
  EXPECT_NE(bg_error_of([&] { read_into({tmp / "a"}, {{0, 900, 200, dst.data(), 0}}, 1, {}); }).find("run past the end"),
            std::string::npos);
  EXPECT_NE(bg_error_of([&] {
              read_into({tmp / "a"}, {{0, 0, 100, dst.data(), 0}, {0, 50, 100, dst.data() + 100, 1}}, 2, {});
            }).find("overlap"),
            std::string::npos);
  EXPECT_NE(bg_error_of([&] { read_into({tmp / "missing"}, {}, 0, {}); }).find("cannot open"), std::string::npos);
}

BuildOptions quiet_build(uint64_t segment_max = uint64_t{1} << 20) {
  BuildOptions o;
  o.layout.segment_max_bytes = segment_max;
  o.progress_tty = 0;
  return o;
}

TEST(Store, BuiltInSharedMemoryAttachedReadOnlyEqualsTheCheckpoint) {
  StoreGuard g;
  const auto model = golden_model("kimi_k3/k3-tiny");
  const StoreInput in = scan_model(model, nullptr);
  BuiltStore b = build_store(in, StoreTarget::shm(g.name()), quiet_build());
  EXPECT_GT(b.manifest.segments.size(), 1u);
  b.segments.clear();
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm" + shm_manifest_name(g.name())).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto src = StoreSource::open_shm(g.name(), 0);
  expect_same_tensors(*src, model);
  // The (layer, expert) block holds its tensors.
  const auto block = src->expert_block(1, 15);
  ASSERT_FALSE(block.empty());
  const auto w2 = src->get("language_model.model.layers.1.block_sparse_moe.experts.15.w2.weight_packed");
  EXPECT_GE(w2.data, block.data());
  EXPECT_LE(w2.data + w2.nbytes, block.data() + block.size());
  EXPECT_TRUE(src->expert_block(0, 0).empty());
  EXPECT_EQ(src->pinnable_regions().size(), b.manifest.segments.size());
  // Mapped read-only: the engine cannot write into the store.
  EXPECT_DEATH(const_cast<std::byte*>(w2.data)[0] = std::byte{1}, "");
}

TEST(Store, VerificationFindsACorruptTensorAndTheCheckpointRepairsIt) {
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  const StoreInput in = scan_model(model, nullptr);
  build_store(in, StoreTarget::shm(g.name()), quiet_build());
  const std::string victim = "model.layers.1.mlp.experts.7.down_proj.weight";
  {
    auto src = StoreSource::open_shm(g.name(), 0);
    const TensorInfo& t = src->manifest().tensors[src->manifest().by_name.at(victim)];
    MappedSegment seg = MappedSegment::open_shm(shm_segment_name(g.name(), t.segment), /*writable=*/true);
    seg.data()[t.offset + 17] ^= std::byte{0x40};
  }
  AdoptResult a =
      open_for_adoption(g.name(), in.tensors, in.arch, in.config_xxh64, ExpertLayout::kCheckpoint, 2, 0);
  ASSERT_TRUE(a.adopted) << a.not_adopted;
  ASSERT_EQ(a.corrupt.size(), 1u);
  EXPECT_EQ(a.manifest.tensors[a.corrupt[0]].name, victim);
  repair_from_input(in, a, a.corrupt, {});
  EXPECT_TRUE(verify_store(a.manifest, a.segments, 2, 0).empty());
  a.segments.clear();
  expect_same_tensors(*StoreSource::open_shm(g.name(), 0), model);
}

TEST(Store, AdoptionRefusesAnotherModelAndSkipsIncompleteStores) {
  StoreGuard g;
  const StoreInput ds = scan_model(golden_model("deepseek_v3/tiny-fp8"), nullptr);
  const StoreInput k3 = scan_model(golden_model("kimi_k3/k3-tiny"), nullptr);
  constexpr ExpertLayout kCk = ExpertLayout::kCheckpoint;
  AdoptResult none = open_for_adoption(g.name(), ds.tensors, ds.arch, ds.config_xxh64, kCk, 1, 0);
  EXPECT_FALSE(none.adopted);
  EXPECT_NE(none.not_adopted.find("no store"), std::string::npos);
  build_store(ds, StoreTarget::shm(g.name()), quiet_build());
  EXPECT_NE(bg_error_of([&] { open_for_adoption(g.name(), k3.tensors, k3.arch, k3.config_xxh64, kCk, 1, 0); })
                .find("holds another model"),
            std::string::npos);
  // A builder that died: the manifest still says "building".
  {
    MappedSegment ms = MappedSegment::open_shm(shm_manifest_name(g.name()), /*writable=*/true);
    ManifestHeader h;
    std::memcpy(&h, ms.data(), sizeof(h));
    h.state = static_cast<uint32_t>(StoreState::kBuilding);
    std::memcpy(ms.data(), &h, sizeof(h));
  }
  AdoptResult partial = open_for_adoption(g.name(), ds.tensors, ds.arch, ds.config_xxh64, kCk, 1, 0);
  EXPECT_FALSE(partial.adopted);
  EXPECT_NE(partial.not_adopted.find("never completed"), std::string::npos) << partial.not_adopted;
  EXPECT_NE(bg_error_of([&] { StoreSource::open_shm(g.name(), 0); }).find("never completed"), std::string::npos);
}

TEST(Store, SegmentOfAnotherGenerationIsRejected) {
  StoreGuard g;
  const StoreInput in = scan_model(golden_model("deepseek_v3/tiny-fp8"), nullptr);
  build_store(in, StoreTarget::shm(g.name()), quiet_build());
  MappedSegment seg = MappedSegment::open_shm(shm_segment_name(g.name(), 0), /*writable=*/true);
  SegmentHeader h;
  std::memcpy(&h, seg.data(), sizeof(h));
  h.generation ^= 1;
  std::memcpy(seg.data(), &h, sizeof(h));
  EXPECT_NE(bg_error_of([&] { StoreSource::open_shm(g.name(), 0); }).find("generation"), std::string::npos);
}

TEST(Store, StoreLayoutDirectoryIsReadDirectlyAndLoadedWithoutRelayout) {
  TempDir tmp;
  StoreGuard g;
  const auto model = golden_model("kimi_k3/k3-tiny");
  BuiltStore on_disk = build_store(scan_model(model, nullptr), StoreTarget::dir(tmp.path()), quiet_build(256 << 10));
  on_disk.segments.clear();
  std::filesystem::copy_file(model / "config.json", tmp / "config.json");
  ASSERT_TRUE(is_store_dir(tmp.path()));
  expect_same_tensors(*StoreSource::open_dir(tmp.path()), model);
  // weightd's path: the directory's own manifest, segment files read straight into shared memory.
  const StoreInput in = scan_model(tmp.path(), nullptr);
  ASSERT_TRUE(in.prebuilt.has_value());
  BuiltStore shm = build_store(in, StoreTarget::shm(g.name()), quiet_build());
  for (size_t i = 0; i < shm.manifest.tensors.size(); ++i) {
    EXPECT_EQ(shm.manifest.tensors[i].offset, in.prebuilt->tensors[i].offset);
  }
  shm.segments.clear();
  expect_same_tensors(*StoreSource::open_shm(g.name(), 0), model);
  // A corrupt segment file is caught by its checksums.
  {
    MappedSegment f = MappedSegment::open_file(tmp / store_segment_file(0), /*writable=*/true);
    const TensorInfo& t = in.prebuilt->tensors.back();
    if (t.segment == 0) f.data()[t.offset] ^= std::byte{1};
    else MappedSegment::open_file(tmp / store_segment_file(t.segment), true).data()[t.offset] ^= std::byte{1};
  }
  remove_store_shm(g.name());
  EXPECT_NE(bg_error_of([&] { build_store(scan_model(tmp.path(), nullptr), StoreTarget::shm(g.name()), quiet_build()); })
                .find("does not match its checksum"),
            std::string::npos);
  EXPECT_TRUE(list_store_shm(g.name()).empty()) << "a failed build leaves nothing behind";
}

// A store-layout checkpoint whose files were cut short (a copy that stopped, a full disk): every way in refuses it
// naming the file, and a failed load leaves no shared memory behind.
TEST(Store, TruncatedStoreLayoutFilesAreClearErrors) {
  TempDir tmp;
  StoreGuard g;
  const auto model = golden_model("deepseek_v3/tiny-fp8");
  BuiltStore on_disk = build_store(scan_model(model, nullptr), StoreTarget::dir(tmp.path()), quiet_build(256 << 10));
  on_disk.segments.clear();
  std::filesystem::copy_file(model / "config.json", tmp / "config.json");
  const auto seg = tmp / store_segment_file(0);
  const auto seg_bytes = std::filesystem::file_size(seg);
  std::filesystem::resize_file(seg, seg_bytes / 2);  // cuts tensors, not only padding
  const std::string opened = bg_error_of([&] { StoreSource::open_dir(tmp.path()); });
  EXPECT_NE(opened.find(seg.filename().string()), std::string::npos) << opened;
  EXPECT_NE(opened.find("the manifest expects"), std::string::npos) << opened;
  const std::string loaded =
      bg_error_of([&] { build_store(scan_model(tmp.path(), nullptr), StoreTarget::shm(g.name()), quiet_build()); });
  EXPECT_NE(loaded.find("run past the end"), std::string::npos) << loaded;
  EXPECT_TRUE(list_store_shm(g.name()).empty()) << "a failed build leaves nothing behind";

  const auto manifest = tmp / kStoreManifestFile;
  const auto manifest_bytes = std::filesystem::file_size(manifest);
  std::filesystem::resize_file(manifest, manifest_bytes / 2);
  const std::string half = bg_error_of([&] { scan_model(tmp.path(), nullptr); });
  EXPECT_NE(half.find(kStoreManifestFile), std::string::npos) << half;
  EXPECT_NE(half.find("runs past"), std::string::npos) << half;
  std::filesystem::resize_file(manifest, 16);
  EXPECT_NE(bg_error_of([&] { StoreSource::open_dir(tmp.path()); }).find("too short for a manifest header"),
            std::string::npos);
}

}  // namespace
}  // namespace bg::testing

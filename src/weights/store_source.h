// A weight store as a WeightSource: the manifest plus its mapped segments (shared memory attached through weightd, or
// the files of a checkpoint converted to the store layout). Every manifest entry is validated against the mappings
// before any view is handed out; views point straight into the segments (no copy).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <span>
#include <string>
#include <vector>

#include "formats/weight_source.h"
#include "weights/segment.h"
#include "weights/store_format.h"

namespace bg::weights {

// File names of a store-layout checkpoint directory (batchgen convert --layout store).
inline constexpr const char* kStoreManifestFile = "store.manifest";
std::string store_segment_file(size_t index);  // "store-seg-00000.bin"
bool is_store_dir(const std::filesystem::path& dir);

// Reads and validates a manifest segment or file's bytes (header, hash, body). `what` names it in errors.
Manifest read_manifest(std::span<const std::byte> bytes, const std::string& what);

class StoreSource final : public WeightSource {
 public:
  // Maps the shared-memory store `name` read-only. expected_generation != 0: the one weightd announced at attach.
  static std::shared_ptr<StoreSource> open_shm(const std::string& name, uint64_t expected_generation);
  // Maps a store-layout checkpoint directory read-only.
  static std::shared_ptr<StoreSource> open_dir(const std::filesystem::path& dir);
  // A store over segments already in memory (peer-fetched tensors); takes ownership.
  StoreSource(std::string describe, Manifest manifest, std::vector<MappedSegment> segments);

  std::string describe() const override { return describe_; }
  // Checkpoint tensors only: a W4A16 block's own record is not one (w4a16_expert gives it).
  bool contains(const std::string& name) const override;
  // A tensor packed into a W4A16 block is unpacked (with its expert's other parts, checked against their checksums)
  // into memory this source owns, once; the view stays valid as long as the source.
  std::optional<TensorView> find(const std::string& name) const override;
  std::string file_of(const std::string& name) const override;
  std::vector<std::string> names() const override;
  std::vector<HostRegion> pinnable_regions() const override;
  std::optional<W4a16Block> w4a16_expert(int64_t layer, int64_t expert) const override;
  // Experts unpacked from W4A16 blocks by every StoreSource of this process (tests check only what is used is).
  static uint64_t experts_unpacked();

  const Manifest& manifest() const { return manifest_; }
  // The (layer, expert) block: its bytes, in one segment. Empty when the store has no such block. O(1).
  std::span<const std::byte> expert_block(int64_t layer, int64_t expert) const;
  std::span<const std::byte> tensor_bytes(uint32_t index) const;
  // Keeps `v` alive as long as the source (the attach handle that detaches from weightd on destruction).
  void hold(std::shared_ptr<void> v) { held_.push_back(std::move(v)); }

 private:
  std::string describe_;
  Manifest manifest_;
  std::vector<MappedSegment> segments_;
  std::vector<std::shared_ptr<void>> held_;
  // Unpacked experts (find on a packed tensor): group -> its six parts back to back, in role order.
  mutable std::mutex unpack_mu_;
  mutable std::unordered_map<uint32_t, std::unique_ptr<std::byte[]>> unpacked_;
};

// Several sources as one: the first that holds a name wins (a node's store, then tensors fetched from peers).
class CompositeSource final : public WeightSource {
 public:
  explicit CompositeSource(std::vector<std::shared_ptr<const WeightSource>> parts);
  std::string describe() const override;
  bool contains(const std::string& name) const override;
  std::optional<TensorView> find(const std::string& name) const override;
  std::string file_of(const std::string& name) const override;
  std::vector<std::string> names() const override;
  std::vector<HostRegion> pinnable_regions() const override;
  std::optional<W4a16Block> w4a16_expert(int64_t layer, int64_t expert) const override;

 private:
  std::vector<std::shared_ptr<const WeightSource>> parts_;
};

}  // namespace bg::weights

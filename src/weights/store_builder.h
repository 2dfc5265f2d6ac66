// Building a weight store: scan a model directory (safetensors shards, or a store-layout directory whose manifest is
// reused as is), plan the layout, create the segments (POSIX shm for weightd, files for `batchgen convert`), read every
// tensor into place with the fast reader (hashing on the way) and write the manifest last, so a store whose builder
// died is never taken for a complete one. Adopting an existing shm store: verify, repair or refuse.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "weights/file_reader.h"
#include "weights/segment.h"
#include "weights/store_layout.h"

namespace bg::weights {

// Where one tensor's bytes are in the input files.
struct SourceRange {
  uint32_t file = 0;
  uint64_t offset = 0;
};

struct StoreInput {
  std::filesystem::path model_dir;
  std::string arch;
  uint64_t config_xxh64 = 0;
  std::vector<std::filesystem::path> files;  // what read_into reads (shards, or segment files)
  std::vector<std::string> sources;          // manifest source names (shard file names)
  std::vector<PlannedTensor> tensors;        // source = index into sources
  std::unordered_map<std::string, SourceRange> ranges;
  std::optional<Manifest> prebuilt;          // a store-layout directory: its own manifest, no re-layout
};

// Scans `dir`: every shard (or only the shard file names in `only_shards`, when not null: a node's share of a
// distributed store; the index must list them), or a store-layout directory. Headers only; nothing is read yet.
StoreInput scan_model(const std::filesystem::path& dir, const std::vector<std::string>* only_shards);

class StoreTarget {
 public:
  static StoreTarget shm(std::string store_name);
  static StoreTarget dir(std::filesystem::path dir);
  std::string describe() const;
  bool is_shm() const { return !store_name_.empty(); }
  // Creates the segments of `m` with their header pages (shm: also the manifest segment, marked "building").
  std::vector<MappedSegment> create(const Manifest& m) const;
  // Writes the manifest with its checksums and marks the store complete.
  void finish(const Manifest& m) const;
  // Removes whatever create() made.
  void remove() const;

 private:
  std::string store_name_;
  std::filesystem::path dir_;
};

struct BuildOptions {
  LayoutOptions layout;  // layout.w4a16_experts is set from expert_layout by build_store
  ExpertLayout expert_layout = ExpertLayout::kCheckpoint;
  ReadOptions read;      // read.progress is set by build_store
  int progress_tty = -1; // see ProgressOptions::tty
  // Called with the load's progress before the first read and with nullptr after the last (weightd's status).
  std::function<void(const LoadProgress*)> on_progress;
};

struct BuildReport {
  uint64_t bytes = 0;
  double seconds = 0.0;
  std::string reader;
  int64_t w4a16_packed = 0;  // experts packed into W4A16 blocks (--expert-layout w4a16)
  int64_t w4a16_kept = 0;    // MXFP4 experts left as stored, and why the first was
  std::string w4a16_first_kept;
  double pack_seconds = 0.0;
};

// A fresh random generation (never 0).
uint64_t new_generation();

// Builds the store of `in` at `target`; returns its manifest (checksums filled) and the writable mappings. On any
// error the target is removed. `extra`: tensors this node lacks (fetched from peers afterwards into the returned
// segments); they are part of the plan with source `extra_source` but are not read here.
struct BuiltStore {
  Manifest manifest;
  std::vector<MappedSegment> segments;
  BuildReport report;
};
BuiltStore build_store(const StoreInput& in, const StoreTarget& target, const BuildOptions& o,
                       const std::vector<PlannedTensor>& extra = {});

// Re-hashes every tensor in parallel (n_threads 0: hardware threads); returns the indices that do not match.
std::vector<uint32_t> verify_store(const Manifest& m, const std::vector<MappedSegment>& segments, int n_threads,
                                   int progress_tty);

struct AdoptResult {
  bool adopted = false;
  std::string not_adopted;  // why not: no store, incomplete, another layout version, a corrupt manifest
  Manifest manifest;
  std::vector<MappedSegment> segments;  // writable
  std::vector<uint32_t> corrupt;        // tensors whose bytes no longer match their checksum
};

// Opens the shm store `name` for adoption when it is complete, of this layout version and expert layout, and holds
// exactly `expected` (the same architecture and config.json, tensor names, dtypes, shapes); then verifies every
// checksum (a W4A16 block's, not its packed parts'). A complete store of another model is an error (never silently
// replaced); an incomplete or unreadable one, or one of another expert layout, is "not adopted".
AdoptResult open_for_adoption(const std::string& name, const std::vector<PlannedTensor>& expected,
                              const std::string& arch, uint64_t config_xxh64, ExpertLayout expert_layout,
                              int n_threads, int progress_tty);

// Re-reads tensors `which` of an adopted store from the checkpoint into their places; a W4A16 block that the input
// does not hold as such is re-packed from its parts. Throws naming the tensor when the re-read (or re-packed) bytes
// still differ from the manifest's checksum (the checkpoint changed since the store was built).
void repair_from_input(const StoreInput& in, AdoptResult& a, const std::vector<uint32_t>& which,
                       const ReadOptions& read);

}  // namespace bg::weights

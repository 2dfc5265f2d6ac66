// Adopting an existing shm store after a daemon restart: identity check, parallel checksum verification, repair.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "weights/checksum.h"
#include "weights/progress.h"
#include "weights/store_builder.h"
#include "weights/store_source.h"

namespace bg::weights {
namespace {

// The store must hold exactly the expected tensors (name, dtype, shape): a different set means a different model or
// checkpoint, which is never adopted.
void check_identity(const std::string& name, const Manifest& m, const std::vector<PlannedTensor>& expected,
                    const std::string& arch, uint64_t config_xxh64) {
  const std::string hint = fmt::format("remove it with `batchgen weightd stop --name {}` (engines still attached keep "
                                       "their mapping) or choose another --name", name);
  BG_CHECK(m.arch == arch && m.config_xxh64 == config_xxh64,
           "weight store {} holds another model ({}, config.json checksum {:#x}; this one: {}, {:#x}); {}", name, m.arch,
           m.config_xxh64, arch, config_xxh64, hint);
  BG_CHECK(m.tensors.size() == expected.size(), "weight store {} holds {} tensors, the checkpoint has {}; {}", name,
           m.tensors.size(), expected.size(), hint);
  for (const PlannedTensor& t : expected) {
    auto it = m.by_name.find(t.name);
    BG_CHECK(it != m.by_name.end(), "weight store {} lacks tensor '{}' of the checkpoint; {}", name, t.name, hint);
    const TensorInfo& s = m.tensors[it->second];
    BG_CHECK(s.dtype == t.dtype && s.shape == t.shape, "weight store {}: tensor '{}' is {} {} there, {} {} in the "
             "checkpoint; {}", name, t.name, dtype_name(s.dtype), shape_str(s.shape), dtype_name(t.dtype),
             shape_str(t.shape), hint);
  }
}

}  // namespace

std::vector<uint32_t> verify_store(const Manifest& m, const std::vector<MappedSegment>& segments, int n_threads,
                                   int progress_tty) {
  std::vector<LoadProgress::File> files;
  for (size_t i = 0; i < m.segments.size(); ++i) files.push_back({fmt::format("segment {}", i), 0});
  for (const TensorInfo& t : m.tensors) files[t.segment].total_bytes += t.bytes;
  LoadProgress progress("verifying checksums", files, {.tty = progress_tty});
  progress.start();
  std::vector<uint8_t> bad(m.tensors.size(), 0);
  std::atomic<size_t> next{0};
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int n = std::max(1, std::min(n_threads > 0 ? n_threads : hw, static_cast<int>(m.tensors.size())));
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&] {
      for (size_t i = next++; i < m.tensors.size(); i = next++) {
        const TensorInfo& ti = m.tensors[i];
        bad[i] = xxh64({segments[ti.segment].data() + ti.offset, ti.bytes}) != ti.xxh64;
        progress.add(ti.segment, ti.bytes);
      }
    });
  }
  for (auto& t : threads) t.join();
  progress.finish();
  std::vector<uint32_t> out;
  for (size_t i = 0; i < bad.size(); ++i) {
    if (bad[i]) out.push_back(static_cast<uint32_t>(i));
  }
  return out;
}

AdoptResult open_for_adoption(const std::string& name, const std::vector<PlannedTensor>& expected,
                              const std::string& arch, uint64_t config_xxh64, int n_threads, int progress_tty) {
  AdoptResult a;
  if (!shm_exists(shm_manifest_name(name))) {
    a.not_adopted = list_store_shm(name).empty() ? "no store in shared memory"
                                                 : "segments without a manifest (an interrupted build)";
    return a;
  }
  MappedSegment ms = MappedSegment::open_shm(shm_manifest_name(name), /*writable=*/false);
  try {
    a.manifest = read_manifest(std::span<const std::byte>(ms.data(), ms.bytes()), "weight store " + name);
  } catch (const Error& e) {
    a.not_adopted = e.what();  // incomplete, another layout version, or a corrupt manifest
    return a;
  }
  check_identity(name, a.manifest, expected, arch, config_xxh64);
  try {
    for (size_t i = 0; i < a.manifest.segments.size(); ++i) {
      a.segments.push_back(MappedSegment::open_shm(shm_segment_name(name, i), /*writable=*/true));
      SegmentHeader h;
      std::memcpy(&h, a.segments.back().data(), sizeof(h));
      check_segment_header(h, a.manifest, static_cast<uint32_t>(i), a.segments.back().bytes(),
                           a.segments.back().what());
    }
  } catch (const Error& e) {
    a.segments.clear();
    a.not_adopted = e.what();  // a missing or foreign segment: the store cannot be trusted as a whole
    return a;
  }
  a.corrupt = verify_store(a.manifest, a.segments, n_threads, progress_tty);
  a.adopted = true;
  return a;
}

void repair_from_input(const StoreInput& in, AdoptResult& a, const std::vector<uint32_t>& which,
                       const ReadOptions& read) {
  std::vector<CopyJob> jobs;
  for (uint32_t i : which) {
    const TensorInfo& t = a.manifest.tensors.at(i);
    auto it = in.ranges.find(t.name);
    BG_CHECK(it != in.ranges.end(), "cannot repair tensor '{}': it is not in {}", t.name, in.model_dir.string());
    jobs.push_back({it->second.file, it->second.offset, t.bytes, a.segments[t.segment].data() + t.offset, i});
  }
  ReadResult r = read_into(in.files, std::move(jobs), a.manifest.tensors.size(), read);
  for (uint32_t i : which) {
    const TensorInfo& t = a.manifest.tensors[i];
    BG_CHECK(r.checksums[i] == t.xxh64, "tensor '{}' re-read from {} still differs from the store's checksum: the "
             "checkpoint changed since the store was built; remove the store (`batchgen weightd stop --name NAME`) "
             "and start again", t.name, in.model_dir.string());
  }
}

}  // namespace bg::weights

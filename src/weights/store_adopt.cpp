// Adopting an existing shm store after a daemon restart: identity check, parallel checksum verification, repair.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "weights/checksum.h"
#include "weights/expert_pack.h"
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
  BG_CHECK(m.n_checkpoint_tensors() == expected.size(), "weight store {} holds {} tensors, the checkpoint has {}; {}",
           name, m.n_checkpoint_tensors(), expected.size(), hint);
  for (const PlannedTensor& t : expected) {
    auto it = m.by_name.find(t.name);
    BG_CHECK(it != m.by_name.end() && m.tensors[it->second].role != TensorRole::kW4a16Block,
             "weight store {} lacks tensor '{}' of the checkpoint; {}", name, t.name, hint);
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
  for (const TensorInfo& t : m.tensors) {
    if (!is_packed_role(t.role)) files[t.segment].total_bytes += t.bytes;
  }
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
        if (is_packed_role(ti.role)) continue;  // inside its W4A16 block, whose checksum covers it
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
                              const std::string& arch, uint64_t config_xxh64, ExpertLayout expert_layout,
                              int n_threads, int progress_tty) {
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
  if (a.manifest.expert_layout != expert_layout) {
    a.not_adopted = fmt::format("it holds experts in the {} layout, --expert-layout asks for {}",
                                expert_layout_name(a.manifest.expert_layout), expert_layout_name(expert_layout));
    return a;
  }
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
  const Manifest& m = a.manifest;
  std::vector<CopyJob> jobs;
  // A W4A16 block the input holds only as its checkpoint parts: the parts are read into scratch, then packed.
  std::vector<std::pair<uint32_t, std::vector<std::byte>>> repack;
  std::vector<uint32_t> checked;
  for (uint32_t i : which) {
    const TensorInfo& t = m.tensors.at(i);
    auto it = in.ranges.find(t.name);
    if (it == in.ranges.end() && t.role == TensorRole::kW4a16Block) {
      const PackedExpert& pe = m.packed.at(t.group);
      uint64_t bytes = 0;
      for (uint32_t p : pe.parts) bytes += m.tensors[p].bytes;
      repack.emplace_back(i, std::vector<std::byte>(bytes));
      std::byte* dst = repack.back().second.data();
      for (uint32_t p : pe.parts) {
        auto pr = in.ranges.find(m.tensors[p].name);
        BG_CHECK(pr != in.ranges.end(), "cannot repair tensor '{}': it is not in {}", m.tensors[p].name,
                 in.model_dir.string());
        jobs.push_back({pr->second.file, pr->second.offset, m.tensors[p].bytes, dst, p});
        dst += m.tensors[p].bytes;
        checked.push_back(p);
      }
      continue;
    }
    BG_CHECK(it != in.ranges.end(), "cannot repair tensor '{}': it is not in {}", t.name, in.model_dir.string());
    jobs.push_back({it->second.file, it->second.offset, t.bytes, a.segments[t.segment].data() + t.offset, i});
    checked.push_back(i);
  }
  ReadResult r = read_into(in.files, std::move(jobs), m.tensors.size(), read);
  auto check = [&](uint32_t i, uint64_t sum, const char* how) {
    BG_CHECK(sum == m.tensors[i].xxh64, "tensor '{}' {} {} still differs from the store's checksum: the checkpoint "
             "changed since the store was built; remove the store (`batchgen weightd stop --name NAME`) and start "
             "again", m.tensors[i].name, how, in.model_dir.string());
  };
  for (uint32_t i : checked) check(i, r.checksums[i], "re-read from");
  for (auto& [i, parts] : repack) {
    const TensorInfo& t = m.tensors[i];
    const PackedExpert& pe = m.packed.at(t.group);
    std::array<std::span<const std::byte>, kPackedRoles> views;
    size_t off = 0;
    for (int k = 0; k < kPackedRoles; ++k) {
      views[static_cast<size_t>(k)] = std::span<const std::byte>(parts).subspan(off, m.tensors[pe.parts[k]].bytes);
      off += m.tensors[pe.parts[k]].bytes;
    }
    std::vector<std::byte> block(t.bytes);
    std::string why;
    BG_CHECK(pack_w4a16_block({pe.hidden, pe.inter, t.bytes}, views, block, &why), "cannot re-pack '{}' from {}: {}",
             t.name, in.model_dir.string(), why);
    check(i, xxh64(block), "re-packed from");
    std::memcpy(a.segments[t.segment].data() + t.offset, block.data(), block.size());
  }
}

}  // namespace bg::weights

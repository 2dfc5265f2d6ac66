// open_weight_source, attach_store (the engine side of the control channel) and the direct path's prefetch.
#include "weights/open_source.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "formats/checkpoint.h"
#include "weights/control.h"
#include "weights/dist_config.h"
#include "weights/peer_fetch.h"
#include "weights/placement.h"
#include "weights/progress.h"
#include "weights/store_source.h"

namespace bg::weights {
namespace {

// Detaches from weightd when the last user of the store's mapping is gone (best effort: a daemon that died meanwhile
// has no clients to count).
class AttachHandle {
 public:
  explicit AttachHandle(std::string store) : store_(std::move(store)) {}
  ~AttachHandle() {
    try {
      control_request(store_, {{"cmd", "detach"}}, 1000);
    } catch (const std::exception&) {
    }
  }
  AttachHandle(const AttachHandle&) = delete;
  AttachHandle& operator=(const AttachHandle&) = delete;

 private:
  std::string store_;
};

uint64_t mem_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

}  // namespace

std::shared_ptr<StoreSource> attach_store(const std::string& store, const std::filesystem::path& model_dir, int wait_s) {
  const auto t0 = std::chrono::steady_clock::now();
  auto last_log = t0;
  nlohmann::json reply;
  for (;;) {
    reply = control_request(store, {{"cmd", "attach"}});
    if (reply.value("ok", false)) break;
    const auto st = reply.value("status", nlohmann::json::object());
    const std::string phase = st.value("phase", std::string("?"));
    BG_CHECK(phase != "failed", "weight store {}: the daemon failed: {}", store, st.value("error", std::string("?")));
    BG_CHECK(st.is_object() && !st.empty(), "weight store {}: {}", store, reply.value("error", std::string("?")));
    const auto now = std::chrono::steady_clock::now();
    BG_CHECK(now - t0 < std::chrono::seconds(wait_s), "weight store {}: still {} after {} s", store, phase, wait_s);
    if (now - last_log > std::chrono::seconds(5) || last_log == t0) {
      const auto pr = st.value("progress", nlohmann::json::object());
      log::info("waiting for weight store {} ({}{})", store, phase,
                pr.empty() ? std::string() : fmt::format(", {} / {}", format_bytes(pr.value("bytes", uint64_t{0})),
                                                         format_bytes(pr.value("total", uint64_t{0}))));
      last_log = now;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  auto handle = std::make_shared<AttachHandle>(store);
  const std::string gen = reply.value("generation", std::string());
  BG_CHECK(gen.size() == 16 && gen.find_first_not_of("0123456789abcdef") == std::string::npos,
           "weight store {}: the daemon announced generation '{}'", store, gen);
  auto source = StoreSource::open_shm(store, std::stoull(gen, nullptr, 16));
  source->hold(handle);
  const uint64_t want = config_checksum(model_dir);
  BG_CHECK(source->manifest().config_xxh64 == want, "weight store {} holds another model than {} (its config.json "
           "checksum is {:#x}, this one's {:#x}); start a store for this model under another --name", store,
           model_dir.string(), source->manifest().config_xxh64, want);
  const Manifest& m = source->manifest();
  log::info("attached to weight store {}: {} tensors, {} in {} segments{}", store, m.n_checkpoint_tensors(),
            format_bytes(m.total_bytes()), m.segments.size(),
            m.packed.empty() ? "" : fmt::format(", {} experts as W4A16 blocks (unpacked on use)", m.packed.size()));
  return source;
}

void prefetch_checkpoint(const WeightSource& source, int progress_tty) {
  const auto* ckpt = dynamic_cast<const Checkpoint*>(&source);
  if (ckpt == nullptr) return;
  std::vector<LoadProgress::File> files;
  struct Chunk {
    size_t file;
    const std::byte* data;
    size_t bytes;
  };
  std::vector<std::vector<Chunk>> per_file;
  uint64_t total = 0;
  constexpr size_t kChunk = size_t{64} << 20;
  for (size_t f = 0; f < ckpt->files().size(); ++f) {
    const auto map = ckpt->files()[f]->mapping();
    files.push_back({ckpt->files()[f]->path().filename().string(), map.size()});
    total += map.size();
    per_file.emplace_back();
    for (size_t off = 0; off < map.size(); off += kChunk) {
      per_file.back().push_back({f, map.data() + off, std::min(kChunk, map.size() - off)});
    }
  }
  const uint64_t avail = mem_available_bytes();
  if (avail > 0 && total > avail / 2) {
    log::info("{}: not prefetching {} (more than half of the {} available); tensors are read on first use",
              source.describe(), format_bytes(total), format_bytes(avail));
    return;
  }
  size_t n_chunks = 0;
  for (const auto& v : per_file) n_chunks += v.size();
  std::vector<Chunk> chunks;  // interleaved across shards so they are read in parallel
  for (size_t k = 0; chunks.size() < n_chunks; ++k) {
    for (const auto& v : per_file) {
      if (k < v.size()) chunks.push_back(v[k]);
    }
  }
  LoadProgress progress("reading " + ckpt->dir().string(), files, {.tty = progress_tty});
  progress.start();
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  const size_t n_threads = std::min<size_t>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u), chunks.size());
  for (size_t t = 0; t < n_threads; ++t) {
    threads.emplace_back([&] {
      for (size_t i = next++; i < chunks.size(); i = next++) {
        const Chunk& c = chunks[i];
        ::madvise(const_cast<std::byte*>(c.data), c.bytes, MADV_WILLNEED);
        uint8_t sum = 0;
        for (size_t off = 0; off < c.bytes; off += 4096) sum ^= static_cast<uint8_t>(c.data[off]);
        static std::atomic<uint8_t> sink{0};
        sink.fetch_xor(sum, std::memory_order_relaxed);  // keeps the reads from being optimised away
        progress.add(c.file, c.bytes);
      }
    });
  }
  for (auto& t : threads) t.join();
  progress.finish();
}

std::shared_ptr<const WeightSource> open_weight_source(const std::filesystem::path& model_dir,
                                                       const SourceOptions& o) {
  std::shared_ptr<const WeightSource> local;
  if (!o.weight_store.empty()) {
    local = attach_store(o.weight_store, model_dir, o.attach_wait_s);
  } else if (o.distributed_weight_config.empty()) {
    if (is_store_dir(model_dir)) return StoreSource::open_dir(model_dir);
    std::shared_ptr<const WeightSource> ckpt = Checkpoint::open(model_dir);
    prefetch_checkpoint(*ckpt, o.progress_tty);
    return ckpt;
  }
  if (o.distributed_weight_config.empty()) return local;
  const DistConfig config = load_dist_config(o.distributed_weight_config);
  const DistNode* self = o.weight_store.empty() ? nullptr : config.node_of_store(o.weight_store);
  const auto have = [&](const std::string& n) { return local != nullptr && local->contains(n); };
  PeerSet peers = PeerSet::connect(config, self != nullptr ? self->name : "", model_dir, have);
  if (peers.clients.empty()) {  // the local store already holds everything
    BG_CHECK(local != nullptr, "{}: no node to fetch the checkpoint from", config.path.string());
    return local;
  }
  const auto plan = plan_fetch(peers, have);
  log::info("{}: fetching {} tensors from {} peer(s)", config.path.string(), plan.size(), peers.clients.size());
  std::shared_ptr<const WeightSource> fetched =
      fetch_to_private(peers, plan, Placement::for_model(model_dir), o.progress_tty);
  if (local == nullptr) return fetched;
  return std::make_shared<CompositeSource>(std::vector<std::shared_ptr<const WeightSource>>{local, fetched});
}

}  // namespace bg::weights

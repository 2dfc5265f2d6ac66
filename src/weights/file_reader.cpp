// read_into: runs of contiguous ranges, chunked reads through io_uring (several in flight, consumed in order so the
// streaming hash sees each range front to back) or pread, scattered into the destinations.
#include "weights/file_reader.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "formats/expert_block.h"
#include "weights/checksum.h"
#include "weights/progress.h"

namespace bg::weights {
namespace {

constexpr size_t kDirectAlign = 4096;

struct OpenFile {
  int fd = -1;
  bool direct = false;
  uint64_t size = 0;
  std::string path;
};

// Opens with O_DIRECT when asked and a probe read of one aligned block succeeds (tmpfs and some network filesystems
// refuse O_DIRECT at open or at read time); otherwise a plain descriptor with a sequential-access hint.
OpenFile open_file(const std::filesystem::path& path, bool try_direct) {
  OpenFile f;
  f.path = path.string();
  if (try_direct) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd >= 0) {
      void* probe = std::aligned_alloc(kDirectAlign, kDirectAlign);
      const bool ok = probe != nullptr && ::pread(fd, probe, kDirectAlign, 0) >= 0;
      std::free(probe);
      if (ok) {
        f.fd = fd;
        f.direct = true;
      } else {
        ::close(fd);
      }
    }
  }
  if (f.fd < 0) {
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    BG_CHECK(f.fd >= 0, "cannot open '{}': {}", f.path, std::strerror(errno));
    ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  }
  const off_t size = ::lseek(f.fd, 0, SEEK_END);
  BG_CHECK(size >= 0, "cannot size '{}': {}", f.path, std::strerror(errno));
  f.size = static_cast<uint64_t>(size);
  return f;
}

// Reads [off, off + len) synchronously until done or end of file; returns the bytes read.
uint64_t pread_full(const OpenFile& f, std::byte* buf, uint64_t off, uint64_t len) {
  uint64_t got = 0;
  while (got < len) {
    const ssize_t n = ::pread(f.fd, buf + got, len - got, static_cast<off_t>(off + got));
    if (n < 0 && errno == EINTR) continue;
    BG_CHECK(n >= 0, "read of '{}' at offset {} failed: {}", f.path, off + got, std::strerror(errno));
    if (n == 0) break;
    got += static_cast<uint64_t>(n);
  }
  return got;
}

// Chunk reads with up to `depth` in flight, each into its own slot buffer.
class ChunkIo {
 public:
  virtual ~ChunkIo() = default;
  virtual void submit(int slot, const OpenFile& f, uint64_t off, uint64_t len) = 0;
  virtual uint64_t wait(int slot) = 0;  // bytes read into the slot's buffer
};

struct SlotRead {
  const OpenFile* file = nullptr;
  uint64_t off = 0, len = 0;
  int64_t result = 0;
  bool done = false;
};

class PreadIo final : public ChunkIo {
 public:
  explicit PreadIo(std::vector<std::byte*> bufs) : bufs_(std::move(bufs)), reads_(bufs_.size()) {}
  void submit(int slot, const OpenFile& f, uint64_t off, uint64_t len) override {
    reads_[static_cast<size_t>(slot)] = {&f, off, len, 0, false};
  }
  uint64_t wait(int slot) override {
    const SlotRead& r = reads_[static_cast<size_t>(slot)];
    return pread_full(*r.file, bufs_[static_cast<size_t>(slot)], r.off, r.len);
  }

 private:
  std::vector<std::byte*> bufs_;
  std::vector<SlotRead> reads_;
};

class UringIo final : public ChunkIo {
 public:
  explicit UringIo(std::vector<std::byte*> bufs) : bufs_(std::move(bufs)), reads_(bufs_.size()) {
    const int err = io_uring_queue_init(static_cast<unsigned>(bufs_.size()), &ring_, 0);
    BG_CHECK(err == 0, "io_uring_queue_init: {}", std::strerror(-err));
  }
  ~UringIo() override {
    // Reap what is still in flight (an error path) before the buffers go away.
    for (const SlotRead& r : reads_) {
      while (r.file != nullptr && !r.done) reap_one();
    }
    io_uring_queue_exit(&ring_);
  }
  void submit(int slot, const OpenFile& f, uint64_t off, uint64_t len) override {
    reads_[static_cast<size_t>(slot)] = {&f, off, len, 0, false};
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    BG_CHECK(sqe != nullptr, "io_uring: submission queue full");
    io_uring_prep_read(sqe, f.fd, bufs_[static_cast<size_t>(slot)], static_cast<unsigned>(len), off);
    io_uring_sqe_set_data64(sqe, static_cast<uint64_t>(slot));
    const int n = io_uring_submit(&ring_);
    BG_CHECK(n >= 0, "io_uring_submit: {}", std::strerror(-n));
  }
  uint64_t wait(int slot) override {
    SlotRead& r = reads_[static_cast<size_t>(slot)];
    while (!r.done) reap_one();
    const OpenFile& f = *r.file;
    r.file = nullptr;
    BG_CHECK(r.result >= 0, "read of '{}' at offset {} failed: {}", f.path, r.off,
             std::strerror(static_cast<int>(-r.result)));
    auto got = static_cast<uint64_t>(r.result);
    // A short read before the end of the file: finish it synchronously.
    if (got < r.len && r.off + got < f.size) {
      got += pread_full(f, bufs_[static_cast<size_t>(slot)] + got, r.off + got, r.len - got);
    }
    return got;
  }

 private:
  void reap_one() {
    io_uring_cqe* cqe = nullptr;
    int err = io_uring_wait_cqe(&ring_, &cqe);
    while (err == -EINTR) err = io_uring_wait_cqe(&ring_, &cqe);
    BG_CHECK(err == 0, "io_uring_wait_cqe: {}", std::strerror(-err));
    SlotRead& r = reads_[static_cast<size_t>(io_uring_cqe_get_data64(cqe))];
    r.result = cqe->res;
    r.done = true;
    io_uring_cqe_seen(&ring_, cqe);
  }
  std::vector<std::byte*> bufs_;
  std::vector<SlotRead> reads_;
  io_uring ring_{};
};

struct Run {
  uint32_t file = 0;
  size_t job_begin = 0, job_end = 0;
  uint64_t begin = 0, end = 0;  // file bytes the jobs cover
};

std::vector<Run> make_runs(const std::vector<CopyJob>& jobs, uint64_t run_target) {
  constexpr uint64_t kMaxGap = uint64_t{1} << 20;  // reading a small gap beats starting a new read
  std::vector<Run> runs;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const CopyJob& j = jobs[i];
    if (!runs.empty()) {
      Run& r = runs.back();
      if (r.file == j.file && j.file_offset >= r.end && j.file_offset - r.end <= kMaxGap &&
          j.file_offset + j.bytes - r.begin <= run_target) {
        r.job_end = i + 1;
        r.end = j.file_offset + j.bytes;
        continue;
      }
    }
    runs.push_back({j.file, i, i + 1, j.file_offset, j.file_offset + j.bytes});
  }
  // Interleave the files' runs so that threads read different shards at once.
  std::vector<std::vector<Run>> per_file;
  for (const Run& r : runs) {
    if (per_file.empty() || per_file.back().front().file != r.file) per_file.emplace_back();
    per_file.back().push_back(r);
  }
  std::vector<Run> out;
  for (size_t k = 0; out.size() < runs.size(); ++k) {
    for (const auto& f : per_file) {
      if (k < f.size()) out.push_back(f[k]);
    }
  }
  return out;
}

// State shared by the reader threads.
struct Shared {
  const std::vector<OpenFile>& files;
  const std::vector<CopyJob>& jobs;
  const std::vector<Run>& runs;
  const ReadOptions& o;
  std::vector<uint64_t>& checksums;
  std::atomic<size_t> next_run{0};
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> bytes{0};
};

void read_run(Shared& s, const Run& run, ChunkIo& io, const std::vector<std::byte*>& bufs, Xxh64Stream& hash) {
  const OpenFile& f = s.files[run.file];
  const uint64_t chunk = s.o.chunk_bytes;
  const uint64_t a = run.begin / kDirectAlign * kDirectAlign;
  const uint64_t b = align_up(run.end, kDirectAlign);
  const uint64_t n_chunks = (b - a + chunk - 1) / chunk;
  const int depth = static_cast<int>(bufs.size());
  auto chunk_range = [&](uint64_t k) { return std::make_pair(a + k * chunk, std::min(b, a + (k + 1) * chunk)); };
  for (uint64_t k = 0; k < n_chunks && static_cast<int>(k) < depth; ++k) {
    auto [lo, hi] = chunk_range(k);
    io.submit(static_cast<int>(k), f, lo, hi - lo);
  }
  size_t j = run.job_begin;
  uint64_t job_done = 0;  // bytes of jobs[j] already copied
  for (uint64_t k = 0; k < n_chunks; ++k) {
    const int slot = static_cast<int>(k % static_cast<uint64_t>(depth));
    const uint64_t got = io.wait(slot);
    BG_CHECK(s.o.cancel == nullptr || !s.o.cancel->load(), "loading cancelled");
    const uint64_t lo = chunk_range(k).first, hi = lo + got;
    uint64_t copied = 0;
    while (j < run.job_end) {
      const CopyJob& job = s.jobs[j];
      const uint64_t from = job.file_offset + job_done;
      if (from >= hi) break;
      BG_CHECK(from >= lo, "'{}': internal: chunk at {} skipped offset {}", f.path, lo, from);
      const uint64_t n = std::min(job.file_offset + job.bytes, hi) - from;
      if (job_done == 0) hash.reset();
      std::memcpy(job.dst + job_done, bufs[slot] + (from - lo), n);
      hash.update(job.dst + job_done, n);
      job_done += n;
      copied += n;
      if (job_done < job.bytes) break;
      s.checksums[job.id] = hash.digest();
      job_done = 0;
      ++j;
    }
    if (s.o.progress != nullptr) s.o.progress->add(run.file, copied);
    s.bytes.fetch_add(copied, std::memory_order_relaxed);
    if (k + depth < n_chunks) {
      auto [nlo, nhi] = chunk_range(k + depth);
      io.submit(slot, f, nlo, nhi - nlo);
    }
  }
  BG_CHECK(j == run.job_end, "'{}' ends at {} bytes, before offset {} that a tensor needs", f.path, f.size,
           s.jobs[j].file_offset + s.jobs[j].bytes);
}

void reader_thread(Shared& s, bool uring, std::exception_ptr& error, std::mutex& error_mu) {
  try {
    const int depth = uring ? std::max(1, s.o.queue_depth) : 1;
    std::vector<std::byte*> bufs;
    std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> owned;
    for (int i = 0; i < depth; ++i) {
      auto* p = static_cast<std::byte*>(std::aligned_alloc(kDirectAlign, s.o.chunk_bytes));
      BG_CHECK(p != nullptr, "cannot allocate a {} byte read buffer", s.o.chunk_bytes);
      owned.emplace_back(p, &std::free);
      bufs.push_back(p);
    }
    std::unique_ptr<ChunkIo> io;
    if (uring) {
      io = std::make_unique<UringIo>(bufs);
    } else {
      io = std::make_unique<PreadIo>(bufs);
    }
    Xxh64Stream hash;
    for (size_t r = s.next_run++; r < s.runs.size() && !s.failed; r = s.next_run++) read_run(s, s.runs[r], *io, bufs, hash);
  } catch (...) {
    s.failed = true;
    std::lock_guard lock(error_mu);
    if (!error) error = std::current_exception();
  }
}

}  // namespace

bool io_uring_available() {
  static const bool available = [] {
    io_uring ring{};
    if (io_uring_queue_init(2, &ring, 0) != 0) return false;
    io_uring_queue_exit(&ring);
    return true;
  }();
  return available;
}

ReadResult read_into(const std::vector<std::filesystem::path>& paths, std::vector<CopyJob> jobs, size_t n_ids,
                     const ReadOptions& o) {
  BG_CHECK(o.chunk_bytes >= kDirectAlign && o.chunk_bytes % kDirectAlign == 0,
           "read chunk of {} bytes is not a multiple of {}", o.chunk_bytes, kDirectAlign);
  const auto t0 = std::chrono::steady_clock::now();
  ReadResult result;
  result.checksums.assign(n_ids, 0);
  std::vector<OpenFile> files;
  struct Closer {
    std::vector<OpenFile>& f;
    ~Closer() {
      for (const OpenFile& x : f) ::close(x.fd);
    }
  } closer{files};
  for (const auto& p : paths) files.push_back(open_file(p, o.direct));
  std::vector<CopyJob> work;
  for (const CopyJob& j : jobs) {
    BG_CHECK(j.file < files.size() && j.id < n_ids, "read_into: job for file {} / id {} out of range", j.file, j.id);
    const OpenFile& f = files[j.file];
    BG_CHECK(j.file_offset <= f.size && j.bytes <= f.size - j.file_offset,
             "'{}': bytes [{}, +{}) run past the end of the {} byte file", f.path, j.file_offset, j.bytes, f.size);
    if (j.bytes == 0) {
      result.checksums[j.id] = xxh64({});
    } else {
      work.push_back(j);
    }
  }
  std::sort(work.begin(), work.end(), [](const CopyJob& x, const CopyJob& y) {
    return x.file != y.file ? x.file < y.file : x.file_offset < y.file_offset;
  });
  for (size_t i = 1; i < work.size(); ++i) {
    BG_CHECK(work[i].file != work[i - 1].file || work[i].file_offset >= work[i - 1].file_offset + work[i - 1].bytes,
             "'{}': ranges overlap at offset {}", files[work[i].file].path, work[i].file_offset);
  }
  uint64_t total = 0;
  for (const CopyJob& j : work) total += j.bytes;
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int want_threads = o.n_threads > 0 ? o.n_threads : std::min(hw, 16);
  const uint64_t run_target = std::clamp<uint64_t>(total / (static_cast<uint64_t>(want_threads) * 4),
                                                   uint64_t{64} << 20, uint64_t{1} << 30);
  const std::vector<Run> runs = make_runs(work, run_target);
  const bool uring = o.kind == ReaderKind::kUring || (o.kind == ReaderKind::kAuto && io_uring_available());
  BG_CHECK(!uring || io_uring_available(), "io_uring was requested but this kernel or sandbox does not allow it");
  bool any_direct = false;
  for (const OpenFile& f : files) any_direct |= f.direct;
  result.reader = std::string(uring ? "io_uring" : "pread") + (any_direct ? " + O_DIRECT" : "");
  Shared s{files, work, runs, o, result.checksums};
  std::exception_ptr error;
  std::mutex error_mu;
  const int n_threads = std::max(1, std::min<int>(want_threads, static_cast<int>(runs.size())));
  std::vector<std::thread> threads;
  for (int t = 0; t < n_threads; ++t) {
    threads.emplace_back([&] { reader_thread(s, uring, error, error_mu); });
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  result.bytes = s.bytes.load();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace bg::weights

// POSIX shm segments, futex waits and peer liveness for CPU rank sets.
#include "dist/shm_set.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "core/log.h"

namespace bg::dist {
namespace {

constexpr uint64_t kControlMagic = 0x62672d73686d3031ULL;  // "bg-shm01"

void futex_wake_all(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Sleeps while *word == expected, at most `ms`; spurious wakes are fine (the caller re-checks).
void futex_wait_ms(const uint32_t* word, uint32_t expected, int64_t ms) {
  timespec ts{static_cast<time_t>(ms / 1000), static_cast<long>((ms % 1000) * 1'000'000)};
  syscall(SYS_futex, const_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// A peer is gone when the pid no longer exists or is a zombie (a child rank of a CLI that has not been reaped yet).
bool process_gone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) S ...": the state follows the last ')'
  return n > 0 && paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

}  // namespace

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (linked_) shm_unlink(name_.c_str());  // the creator gave up before every rank attached
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) munmap(data_, size_);
    if (linked_) shm_unlink(name_.c_str());
    name_ = std::move(o.name_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    linked_ = std::exchange(o.linked_, false);
  }
  return *this;
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  BG_CHECK(bytes > 0, "shm segment {}: size 0", name);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  BG_CHECK(fd >= 0, "shm segment {}: shm_open failed: {}", name, std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    fail("shm segment {}: cannot size it to {} bytes: {} (is /dev/shm large enough?)", name, bytes,
         std::strerror(err));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    fail("shm segment {}: mmap of {} bytes failed: {}", name, bytes, std::strerror(errno));
  }
  ShmSegment s;
  s.name_ = name;
  s.data_ = static_cast<std::byte*>(p);
  s.size_ = bytes;
  s.linked_ = true;
  return s;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  BG_CHECK(fd >= 0, "shm segment {}: shm_open failed: {}", name, std::strerror(errno));
  struct stat st{};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    fail("shm segment {}: holds {} bytes, expected {}", name, static_cast<int64_t>(st.st_size), bytes);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  BG_CHECK(p != MAP_FAILED, "shm segment {}: mmap failed: {}", name, std::strerror(errno));
  ShmSegment s;
  s.name_ = name;
  s.data_ = static_cast<std::byte*>(p);
  s.size_ = bytes;
  return s;
}

void ShmSegment::unlink() {
  if (linked_) shm_unlink(name_.c_str());
  linked_ = false;
}

std::string unique_shm_name(const std::string& what) {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) | rd();
  return fmt::format("/batchgen-{}-{}-{:016x}", what, getpid(), r);
}

void store_and_wake(uint32_t* word, uint32_t value) {
  std::atomic_ref<uint32_t>(*word).store(value, std::memory_order_release);
  futex_wake_all(word);
}

void bump_and_wake(uint32_t* word) {
  std::atomic_ref<uint32_t>(*word).fetch_add(1, std::memory_order_acq_rel);
  futex_wake_all(word);
}

uint32_t load_acquire(const uint32_t* word) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_acquire);
}

ShmSet::ShmSet(ShmControl* control, int32_t world, int32_t rank, double timeout_s)
    : c_(control), world_(world), rank_(rank), timeout_s_(timeout_s) {
  BG_CHECK(world >= 1 && world <= kMaxRanks && rank >= 0 && rank < world, "shm set: rank {} of {}", rank, world);
}

void ShmSet::attach_and_wait() {
  // The creator zero-filled the segment; the first rank to attach (any) writes the magic and world.
  std::atomic_ref<int32_t>(c_->pids[rank_]).store(static_cast<int32_t>(getpid()), std::memory_order_release);
  uint64_t zero = 0;
  std::atomic_ref<uint64_t>(c_->magic).compare_exchange_strong(zero, kControlMagic);
  int32_t none = 0;
  std::atomic_ref<int32_t>(c_->world).compare_exchange_strong(none, world_);
  BG_CHECK(std::atomic_ref<int32_t>(c_->world).load() == world_, "shm set: the segment is for {} ranks, not {}",
           c_->world, world_);
  const uint32_t n = std::atomic_ref<uint32_t>(c_->n_attached).fetch_add(1, std::memory_order_acq_rel) + 1;
  futex_wake_all(&c_->n_attached);
  (void)n;
  wait(&c_->n_attached, [&] { return load_acquire(&c_->n_attached) >= static_cast<uint32_t>(world_); },
       "every rank to attach");
}

void ShmSet::mark_failed(int32_t rank, const std::string& reason) const {
  uint32_t expected = 0;
  if (std::atomic_ref<uint32_t>(c_->failed).compare_exchange_strong(expected, static_cast<uint32_t>(rank + 1))) {
    std::snprintf(c_->reason, sizeof(c_->reason), "%s", reason.c_str());
  }
  futex_wake_all(&c_->failed);
}

void ShmSet::check_peers() const {
  const uint32_t failed = load_acquire(&c_->failed);
  if (failed != 0) {
    // The writer stores the reason right after winning the flag; give it a moment so the message is complete.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    throw RankFailure(fmt::format("rank {}: the rank set failed (rank {}): {}", rank_, failed - 1,
                                  std::string(c_->reason, strnlen(c_->reason, sizeof(c_->reason)))));
  }
  for (int32_t r = 0; r < world_; ++r) {
    const int32_t pid = std::atomic_ref<int32_t>(c_->pids[r]).load(std::memory_order_acquire);
    if (r != rank_ && process_gone(pid)) {
      const std::string why = fmt::format("rank {} (pid {}) exited", r, pid);
      mark_failed(r, why);
      throw RankFailure(fmt::format("rank {}: {}", rank_, why));
    }
  }
}

void ShmSet::fail_wait(const char* what, const std::string& why) const {
  const std::string reason = fmt::format("rank {} gave up waiting for {}: {}", rank_, what, why);
  mark_failed(rank_, reason);
  throw RankFailure(reason);
}

void ShmSet::wait(const uint32_t* word, const std::function<bool()>& done, const char* what) const {
  for (int i = 0; i < 256; ++i) {  // a peer that is a few microseconds behind: spin, do not sleep
    if (done()) return;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto last_check = start;
  for (;;) {
    const uint32_t seen = load_acquire(word);
    if (done()) return;
    futex_wait_ms(word, seen, 20);
    if (done()) return;
    const auto now = Clock::now();
    if (load_acquire(&c_->failed) != 0 || now - last_check >= std::chrono::milliseconds(100)) {
      check_peers();
      last_check = now;
    }
    if (std::chrono::duration<double>(now - start).count() > timeout_s_) {
      fail_wait(what, fmt::format("no progress in {:.0f} s (BG_RANK_TIMEOUT_S)", timeout_s_));
    }
  }
}

}  // namespace bg::dist

// MappedSegment: shm_open / open + mmap with ownership and mode checks, NUMA placement, up-front page reservation.
#include "weights/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <numa.h>
#include <numaif.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "core/log.h"

namespace bg::weights {
namespace {

// Closes an fd when it goes out of scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

std::byte* map_fd(int fd, size_t bytes, bool writable, const std::string& what) {
  BG_CHECK(bytes > 0, "{}: empty segment", what);
  void* p = ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  BG_CHECK(p != MAP_FAILED, "{}: cannot map {} bytes: {}", what, bytes, std::strerror(errno));
  return static_cast<std::byte*>(p);
}

// Binds the mapping's (shared) memory policy to `node` before any page exists, so every page lands there whichever
// thread touches it first.
void place_on_node(std::byte* p, size_t bytes, int node, const std::string& what) {
  if (node < 0 || numa_available() < 0) return;
  BG_CHECK(node <= numa_max_node(), "{}: NUMA node {} does not exist (max {})", what, node, numa_max_node());
  unsigned long mask[16] = {};
  mask[node / 64] = 1UL << (node % 64);
  if (::mbind(p, bytes, MPOL_PREFERRED, mask, sizeof(mask) * 8, 0) != 0) {
    log::warn("{}: mbind to NUMA node {} failed ({}); pages follow the default policy", what, node,
              std::strerror(errno));
  }
}

void check_private(const struct stat& st, const std::string& what) {
  BG_CHECK(st.st_uid == ::geteuid(), "{}: owned by uid {}, not by this user ({}); refusing to use it", what,
           st.st_uid, ::geteuid());
  BG_CHECK((st.st_mode & 077) == 0, "{}: mode {:o} lets other users in; refusing to use it", what,
           st.st_mode & 0777);
}

}  // namespace

MappedSegment::~MappedSegment() {
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

MappedSegment::MappedSegment(MappedSegment&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)),
      what_(std::move(other.what_)) {}

MappedSegment& MappedSegment::operator=(MappedSegment&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    what_ = std::move(other.what_);
  }
  return *this;
}

MappedSegment MappedSegment::create_shm(const std::string& shm_name, size_t bytes, int numa_node) {
  MappedSegment s;
  s.what_ = "shared memory " + shm_name;
  Fd fd{::shm_open(shm_name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600)};
  BG_CHECK(fd.fd >= 0, "{}: cannot create: {}", s.what_, std::strerror(errno));
  if (::ftruncate(fd.fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::shm_unlink(shm_name.c_str());
    fail("{}: cannot size to {} bytes: {}", s.what_, bytes, std::strerror(err));
  }
  s.data_ = map_fd(fd.fd, bytes, /*writable=*/true, s.what_);
  s.bytes_ = bytes;
  place_on_node(s.data_, bytes, numa_node, s.what_);
  ::madvise(s.data_, bytes, MADV_HUGEPAGE);  // shmem THP where the admin enabled it ("advise"); harmless otherwise
  if (const int err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes)); err != 0) {
    ::shm_unlink(shm_name.c_str());
    fail("{}: cannot reserve {} bytes ({}); /dev/shm has {} bytes free (its size is a mount option: "
         "mount -o remount,size=...)", s.what_, bytes, std::strerror(err), shm_free_bytes());
  }
  return s;
}

MappedSegment MappedSegment::open_shm(const std::string& shm_name, bool writable) {
  MappedSegment s;
  s.what_ = "shared memory " + shm_name;
  Fd fd{::shm_open(shm_name.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0)};
  BG_CHECK(fd.fd >= 0, "{}: cannot open: {}", s.what_, std::strerror(errno));
  struct stat st {};
  BG_CHECK(::fstat(fd.fd, &st) == 0, "{}: fstat: {}", s.what_, std::strerror(errno));
  check_private(st, s.what_);
  s.bytes_ = static_cast<size_t>(st.st_size);
  s.data_ = map_fd(fd.fd, s.bytes_, writable, s.what_);
  return s;
}

MappedSegment MappedSegment::create_file(const std::filesystem::path& path, size_t bytes) {
  MappedSegment s;
  s.what_ = path.string();
  Fd fd{::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  BG_CHECK(fd.fd >= 0, "cannot create '{}': {}", s.what_, std::strerror(errno));
  BG_CHECK(::ftruncate(fd.fd, static_cast<off_t>(bytes)) == 0, "cannot size '{}' to {} bytes: {}", s.what_, bytes,
           std::strerror(errno));
  if (const int err = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes)); err != 0 && err != EOPNOTSUPP) {
    fail("cannot reserve {} bytes for '{}': {}", bytes, s.what_, std::strerror(err));
  }
  s.data_ = map_fd(fd.fd, bytes, /*writable=*/true, s.what_);
  s.bytes_ = bytes;
  return s;
}

MappedSegment MappedSegment::open_file(const std::filesystem::path& path, bool writable) {
  MappedSegment s;
  s.what_ = path.string();
  Fd fd{::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC)};
  BG_CHECK(fd.fd >= 0, "cannot open '{}': {}", s.what_, std::strerror(errno));
  struct stat st {};
  BG_CHECK(::fstat(fd.fd, &st) == 0 && S_ISREG(st.st_mode), "'{}' is not a regular file", s.what_);
  s.bytes_ = static_cast<size_t>(st.st_size);
  s.data_ = map_fd(fd.fd, s.bytes_, writable, s.what_);
  return s;
}

MappedSegment MappedSegment::anonymous(size_t bytes) {
  MappedSegment s;
  s.what_ = "private memory";
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  BG_CHECK(p != MAP_FAILED, "cannot allocate {} bytes of private memory: {}", bytes, std::strerror(errno));
  s.data_ = static_cast<std::byte*>(p);
  s.bytes_ = bytes;
  return s;
}

void check_store_name(const std::string& name) {
  BG_CHECK(!name.empty() && name.size() <= 64, "weight store name '{}' must be 1 to 64 characters", name);
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '-';
    BG_CHECK(ok, "weight store name '{}': only letters, digits, '_' and '-' are allowed", name);
  }
}

static std::string shm_prefix(const std::string& store) {
  check_store_name(store);
  return fmt::format("bg.{}.{}.", ::geteuid(), store);
}

std::string shm_manifest_name(const std::string& store) { return "/" + shm_prefix(store) + "manifest"; }

std::string shm_segment_name(const std::string& store, size_t index) {
  return fmt::format("/{}seg{}", shm_prefix(store), index);
}

bool shm_exists(const std::string& shm_name) {
  const int fd = ::shm_open(shm_name.c_str(), O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

std::vector<std::string> list_store_shm(const std::string& store) {
  const std::string prefix = shm_prefix(store);
  std::vector<std::string> out;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return out;
  while (const dirent* e = ::readdir(dir)) {
    const std::string n = e->d_name;
    if (n.compare(0, prefix.size(), prefix) == 0) out.push_back("/" + n);
  }
  ::closedir(dir);
  return out;
}

size_t remove_store_shm(const std::string& store) {
  size_t n = 0;
  for (const std::string& name : list_store_shm(store)) n += ::shm_unlink(name.c_str()) == 0;
  return n;
}

size_t shm_free_bytes() {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return 0;
  return static_cast<size_t>(st.f_bavail) * st.f_frsize;
}

}  // namespace bg::weights

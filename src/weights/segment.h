// Mapped store segments: POSIX shared-memory objects (the daemon writes them, engines map them read-only) or files (a
// checkpoint converted to the store layout), and the names a store's objects have in /dev/shm.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

namespace bg::weights {

class MappedSegment {
 public:
  MappedSegment() = default;
  ~MappedSegment();
  MappedSegment(MappedSegment&& other) noexcept;
  MappedSegment& operator=(MappedSegment&& other) noexcept;
  MappedSegment(const MappedSegment&) = delete;
  MappedSegment& operator=(const MappedSegment&) = delete;

  // A new shared-memory object (mode 0600, fails if it exists) of `bytes`, its pages reserved up front (so a full
  // /dev/shm is an error here, not a SIGBUS later) and placed on `numa_node` (-1: no policy). Mapped read-write.
  static MappedSegment create_shm(const std::string& shm_name, size_t bytes, int numa_node);
  // An existing shared-memory object, which must belong to this user and not be accessible to others.
  static MappedSegment open_shm(const std::string& shm_name, bool writable);
  // A new file of `bytes` (replaced if present), mapped read-write; an existing file, mapped read-only or read-write.
  static MappedSegment create_file(const std::filesystem::path& path, size_t bytes);
  static MappedSegment open_file(const std::filesystem::path& path, bool writable);
  // Anonymous private memory (peer-fetched tensors of an engine).
  static MappedSegment anonymous(size_t bytes);

  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  const std::string& what() const { return what_; }  // "shared memory /bg.0.k3.seg2" / the file path
  bool empty() const { return data_ == nullptr; }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  std::string what_;
};

// Names of a store's shared-memory objects: "/bg.<uid>.<store>.manifest" and "/bg.<uid>.<store>.seg<k>". The uid
// keeps users apart; store names are [A-Za-z0-9_-]{1,64}.
void check_store_name(const std::string& name);
std::string shm_manifest_name(const std::string& store);
std::string shm_segment_name(const std::string& store, size_t index);
bool shm_exists(const std::string& shm_name);
// Every shared-memory object of `store` (listed from /dev/shm), including leftovers of an incomplete build.
std::vector<std::string> list_store_shm(const std::string& store);
// Unlinks them all; returns how many there were.
size_t remove_store_shm(const std::string& store);
// Bytes free in /dev/shm (statvfs).
size_t shm_free_bytes();

}  // namespace bg::weights

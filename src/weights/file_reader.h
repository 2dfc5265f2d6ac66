// Fast loading: copies byte ranges of files (checkpoint shards, store segment files) into memory with large reads
// and hashes each range on the way (XXH64). Ranges are sorted by file offset and cut into runs of contiguous bytes;
// threads take runs (interleaved across files, so shards are read in parallel) and read each in chunks through
// io_uring with several reads in flight (liburing), or pread where the kernel refuses io_uring. Files are opened with
// O_DIRECT where the filesystem allows it (page-cache bypass: no double copy, no eviction storm).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace bg::weights {

class LoadProgress;

// One range: file bytes [file_offset, file_offset + bytes) -> dst; its XXH64 goes to checksums[id].
struct CopyJob {
  uint32_t file = 0;
  uint64_t file_offset = 0;
  uint64_t bytes = 0;
  std::byte* dst = nullptr;
  uint32_t id = 0;
};

enum class ReaderKind { kAuto, kUring, kPread };

struct ReadOptions {
  int n_threads = 0;                  // 0: min(hardware threads, 16)
  size_t chunk_bytes = size_t{16} << 20;
  int queue_depth = 4;                // io_uring reads in flight per thread
  ReaderKind kind = ReaderKind::kAuto;
  bool direct = true;                 // try O_DIRECT
  LoadProgress* progress = nullptr;   // file i of the progress = files[i]
  const std::atomic<bool>* cancel = nullptr;  // set: the read stops at the next chunk with a "cancelled" error
};

struct ReadResult {
  std::vector<uint64_t> checksums;  // by job id
  std::string reader;               // "io_uring" | "pread" (+ " O_DIRECT" where it was used)
  uint64_t bytes = 0;               // bytes copied
  double seconds = 0.0;
};

// Throws bg::Error naming the file on open/read errors, ranges past a file's end, or overlapping destinations.
ReadResult read_into(const std::vector<std::filesystem::path>& files, std::vector<CopyJob> jobs, size_t n_ids,
                     const ReadOptions& options);

// Whether io_uring can be used in this process (the kernel may have it disabled or a seccomp filter may block it).
bool io_uring_available();

}  // namespace bg::weights

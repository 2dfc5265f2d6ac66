// The frontend's private directory for the worker IPC socket (mode 0700, under the temp dir), with an owner file
// naming the serve process, and the sweep at start that removes the directories of serve processes that are gone
// (killed with SIGKILL, so they never cleaned up).
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace bg::frontend {

inline constexpr const char* kIpcDirPrefix = "batchgen-serve-";

class IpcDir {
 public:
  // Creates <parent>/batchgen-serve-XXXXXX (mkdtemp: mode 0700) and its owner file ("<pid> <start time>").
  explicit IpcDir(const std::filesystem::path& parent = std::filesystem::temp_directory_path());
  ~IpcDir();
  IpcDir(const IpcDir&) = delete;
  IpcDir& operator=(const IpcDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// Removes the batchgen-serve-* directories in `parent` owned by this user whose serve process is gone: the owner
// file names a process that no longer exists (or a different process with the same pid), or — for a directory
// without an owner file — its socket refuses connections and it is older than a minute. Returns how many it removed.
size_t sweep_stale_ipc_dirs(const std::filesystem::path& parent = std::filesystem::temp_directory_path());

// The start time of a process in clock ticks since boot (/proc/<pid>/stat field 22); 0 when it does not exist.
unsigned long long process_start_time(long pid);

}  // namespace bg::frontend

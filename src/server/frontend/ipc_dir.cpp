// Private IPC directories: creation with an owner file, removal, and the sweep of directories of dead processes.
#include "server/frontend/ipc_dir.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/log.h"

namespace bg::frontend {

namespace fs = std::filesystem;

namespace {

constexpr const char* kOwnerFile = "owner";
constexpr const char* kSocketFile = "workers.sock";
constexpr auto kUnownedGrace = std::chrono::minutes(1);  // a directory being created has no owner file yet

bool process_exists(long pid) { return pid > 0 && (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM); }

// True when nothing accepts connections on the unix socket at `path` (or it is not a socket).
bool socket_is_dead(const fs::path& path) {
  const std::string p = path.string();
  sockaddr_un addr{};
  if (p.size() >= sizeof(addr.sun_path)) return false;
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, p.c_str(), p.size() + 1);
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  close(fd);
  return rc != 0 && (err == ECONNREFUSED || err == ENOENT);
}

bool is_stale(const fs::path& dir) {
  std::ifstream owner(dir / kOwnerFile);
  if (owner.good()) {
    long pid = 0;
    unsigned long long start = 0;
    owner >> pid >> start;
    if (!owner || pid <= 0) return false;  // unreadable: leave it alone
    return !process_exists(pid) || process_start_time(pid) != start;
  }
  std::error_code ec;
  const auto age = fs::file_time_type::clock::now() - fs::last_write_time(dir, ec);
  if (ec || age < kUnownedGrace) return false;
  return socket_is_dead(dir / kSocketFile);
}

}  // namespace

unsigned long long process_start_time(long pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return 0;
  std::istringstream fields(stat.substr(paren + 2));
  std::string field;
  // Fields after the name start at 3 (state); the start time is field 22.
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

IpcDir::IpcDir(const fs::path& parent) {
  std::string tmpl = (parent / (std::string(kIpcDirPrefix) + "XXXXXX")).string();
  BG_CHECK(mkdtemp(tmpl.data()) != nullptr, "serve: cannot create a private directory under {}: {}", parent.string(),
           std::strerror(errno));
  path_ = tmpl;
  std::ofstream owner(path_ / kOwnerFile);
  owner << getpid() << ' ' << process_start_time(getpid()) << '\n';
  BG_CHECK(owner.good(), "serve: cannot write {}", (path_ / kOwnerFile).string());
}

IpcDir::~IpcDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

size_t sweep_stale_ipc_dirs(const fs::path& parent) {
  std::error_code ec;
  size_t removed = 0;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& dir = it->path();
    if (dir.filename().string().rfind(kIpcDirPrefix, 0) != 0) continue;
    struct stat st {};
    if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid()) continue;
    if (!is_stale(dir)) continue;
    std::error_code rm;
    fs::remove_all(dir, rm);
    if (rm) {
      log::warn("serve: cannot remove the stale directory {}: {}", dir.string(), rm.message());
    } else {
      ++removed;
    }
  }
  if (removed > 0) log::info("serve: removed {} stale IPC director{} of serve processes that are gone", removed,
                             removed == 1 ? "y" : "ies");
  return removed;
}

}  // namespace bg::frontend

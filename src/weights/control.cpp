// Runtime directory, control socket paths, the client side of a control request, peer credentials.
#include "weights/control.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <zmq.hpp>

#include "core/error.h"
#include "weights/segment.h"

namespace bg::weights {

namespace fs = std::filesystem;

fs::path runtime_dir() {
  fs::path dir;
  if (const char* env = std::getenv("BG_RUNTIME_DIR"); env != nullptr && *env != '\0') {
    dir = env;
  } else if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    dir = fs::path(xdg) / "batchgen";
  } else {
    dir = fmt::format("/tmp/batchgen-{}", ::geteuid());
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    fail("cannot create the runtime directory {}: {}", dir.string(), std::strerror(errno));
  }
  struct stat st {};
  BG_CHECK(::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "runtime directory {} is not a directory",
           dir.string());
  BG_CHECK(st.st_uid == ::geteuid(), "runtime directory {} belongs to uid {}, not to this user; set BG_RUNTIME_DIR",
           dir.string(), st.st_uid);
  BG_CHECK((st.st_mode & 077) == 0, "runtime directory {} has mode {:o}: other users could reach the daemon's socket; "
           "chmod 700 it", dir.string(), st.st_mode & 0777);
  return dir;
}

fs::path control_socket_path(const std::string& store) {
  check_store_name(store);
  fs::path p = runtime_dir() / ("weightd-" + store + ".sock");
  BG_CHECK(p.string().size() < 100, "control socket path {} is too long for a unix socket; set BG_RUNTIME_DIR to a "
           "shorter directory", p.string());
  return p;
}

fs::path lock_file_path(const std::string& store) {
  check_store_name(store);
  return runtime_dir() / ("weightd-" + store + ".lock");
}

fs::path log_file_path(const std::string& store) {
  check_store_name(store);
  return runtime_dir() / ("weightd-" + store + ".log");
}

std::string control_endpoint(const std::string& store) { return "ipc://" + control_socket_path(store).string(); }

bool daemon_running(const std::string& store) {
  const int fd = ::open(lock_file_path(store).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

nlohmann::json control_request(const std::string& store, const nlohmann::json& request, int timeout_ms) {
  const fs::path sock = control_socket_path(store);
  std::error_code ec;
  BG_CHECK(daemon_running(store) && fs::exists(sock, ec),
           "no weight daemon named '{}' is running (start one with `batchgen weightd start --model DIR --name {}`)",
           store, store);
  zmq::context_t ctx(1);
  zmq::socket_t s(ctx, zmq::socket_type::req);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, timeout_ms);
  s.set(zmq::sockopt::sndtimeo, timeout_ms);
  s.connect("ipc://" + sock.string());
  const std::string text = request.dump();
  BG_CHECK(s.send(zmq::buffer(text), zmq::send_flags::none).has_value(),
           "weight daemon '{}' did not take the request within {} ms", store, timeout_ms);
  zmq::message_t reply;
  BG_CHECK(s.recv(reply, zmq::recv_flags::none).has_value(), "weight daemon '{}' did not answer within {} ms", store,
           timeout_ms);
  auto j = nlohmann::json::parse(reply.to_string_view(), nullptr, /*allow_exceptions=*/false);
  BG_CHECK(j.is_object(), "weight daemon '{}' sent a reply that is not a JSON object", store);
  return j;
}

std::optional<PeerCredentials> parse_peer_address(const char* peer_address) {
  if (peer_address == nullptr) return std::nullopt;
  // The last three ':'-separated fields are uid, gid and pid (libzmq fills them from SO_PEERCRED for ipc).
  std::string s(peer_address);
  long long v[3];
  for (int i = 2; i >= 0; --i) {
    const size_t colon = s.rfind(':');
    if (colon == std::string::npos) return std::nullopt;
    const std::string field = s.substr(colon + 1);
    if (field.empty() || field.find_first_not_of("0123456789") != std::string::npos || field.size() > 10) {
      return std::nullopt;
    }
    v[i] = std::stoll(field);
    s.resize(colon);
  }
  return PeerCredentials{static_cast<uid_t>(v[0]), static_cast<gid_t>(v[1]), static_cast<pid_t>(v[2])};
}

unsigned long long process_start_ticks(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  if (!in.good()) return 0;
  std::string line;
  std::getline(in, line);
  // Field 2 (comm) is in parentheses and may contain spaces: count fields after the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

}  // namespace bg::weights

// The weightd control channel: a ZeroMQ socket at ipc://<runtime dir>/weightd-<name>.sock, one JSON request, one JSON
// reply. The runtime directory is per user and mode 0700; the daemon also filters connections by uid (kernel peer
// credentials) and checks them again on every request, so only the owning user reaches a store's daemon.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace bg::weights {

// $BG_RUNTIME_DIR, else $XDG_RUNTIME_DIR/batchgen, else /tmp/batchgen-<uid>: created with mode 0700 when missing;
// an existing one must belong to this user and not be accessible to others.
std::filesystem::path runtime_dir();
std::filesystem::path control_socket_path(const std::string& store);
std::filesystem::path lock_file_path(const std::string& store);
std::filesystem::path log_file_path(const std::string& store);
std::string control_endpoint(const std::string& store);

// True when a daemon holds the store's lock (it is running, possibly still loading).
bool daemon_running(const std::string& store);

// Sends `request` to the daemon of `store` and returns its reply. Throws bg::Error saying that no daemon of that name
// is running (with the command that starts one), or that it did not answer within `timeout_ms`.
nlohmann::json control_request(const std::string& store, const nlohmann::json& request, int timeout_ms = 10000);

// The kernel's credentials of a ZeroMQ ipc peer, from the "Peer-Address" message property (":<uid>:<gid>:<pid>").
struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};
std::optional<PeerCredentials> parse_peer_address(const char* peer_address);

// The start time of a process (clock ticks since boot, /proc/<pid>/stat field 22); 0 when it does not exist. A
// (pid, start time) pair names one process even after its pid is reused.
unsigned long long process_start_ticks(pid_t pid);

}  // namespace bg::weights

// The control protocol between node 0 of a serve that spans hosts (its NodeLink) and the node agents of nodes 1..
// (node_agent.h): the addresses node 0 binds, derived from --dist-init-addr, and the messages, JSON objects
// {"type", "body"} over ZeroMQ ROUTER (node 0) / DEALER (agent). Every received message is validated here (type,
// field types and ranges, sizes) before either side acts on it. docs/PARALLEL.md, "Several nodes".
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace bg::frontend::nodes {

// Where node 0 listens, all on the --dist-init-addr host only.
struct NodeEndpoints {
  std::string host;
  int port = 0;
  std::string control;          // tcp://HOST:PORT: the agents connect here
  std::string worker_link;      // tcp://HOST:PORT+1: every rank's worker connects here (node 0's WorkerLink)
  std::string rendezvous_bind;  // tcp://HOST:*: each incarnation's rendezvous, on a fresh ephemeral port
};
// Throws bg::Error naming --dist-init-addr when it is not host:port with a port in [1, 65534].
NodeEndpoints node_endpoints(const std::string& dist_init_addr);

inline constexpr std::chrono::milliseconds kHeartbeatInterval{250};  // both sides, while connected
inline constexpr size_t kMaxFrameBytes = size_t{1} << 16;
inline constexpr int32_t kMaxRoutingIdBytes = 96;

// Agent -> node 0, first: who it is and what it was started with (config must equal node 0's).
struct Hello {
  int32_t node_rank = 0;
  int32_t nnodes = 0;
  std::string config;  // config_signature() of the agent's options
  int64_t pid = 0;
  std::string host;
};

// Node 0 -> agent: start this node's ranks for one incarnation of the set.
struct StartRanks {
  int64_t incarnation = 0;
  std::string rendezvous;                                 // tcp://HOST:port of this incarnation's rendezvous
  std::vector<std::pair<int32_t, std::string>> ranks;     // (rank, routing id), this node's ranks in order
};

// Agent -> node 0: a rank process started ("started": wait_status unused) or was reaped ("exited").
struct RankProcess {
  int64_t incarnation = 0;
  int32_t rank = 0;
  int64_t pid = 0;
  int32_t wait_status = 0;
};

struct ControlMessage {
  std::string type;
  nlohmann::json body;
};

std::string encode(const std::string& type, const nlohmann::json& body = nlohmann::json::object());
// Throws bg::Error when the frame is oversized, not a JSON object {"type": string, "body": object}, or of a type
// outside `allowed`.
ControlMessage decode(const std::string& frame, const std::vector<std::string>& allowed);

nlohmann::json to_json(const Hello& h);
nlohmann::json to_json(const StartRanks& s);
nlohmann::json to_json(const RankProcess& p);
// The parsers check every field (types, ranges, lengths); StartRanks also that its ranks are exactly node
// `node_rank`'s of `world` ranks over `nnodes` nodes and its rendezvous is tcp://HOST:port on `host`.
Hello parse_hello(const nlohmann::json& body);
StartRanks parse_start(const nlohmann::json& body, int32_t world, int32_t nnodes, int32_t node_rank,
                       const std::string& host);
RankProcess parse_rank_process(const nlohmann::json& body);
std::string parse_reason(const nlohmann::json& body);  // "error" / "bye": {"reason": string}, at most 4096 bytes

}  // namespace bg::frontend::nodes

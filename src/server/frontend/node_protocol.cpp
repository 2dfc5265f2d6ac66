// Node control messages: encoding, and parsing that trusts nothing it receives.
#include "server/frontend/node_protocol.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "dist/parallel_layout.h"

namespace bg::frontend::nodes {

using json = nlohmann::json;

namespace {

int64_t int_field(const json& body, const char* name, int64_t lo, int64_t hi) {
  const auto it = body.find(name);
  BG_CHECK(it != body.end() && it->is_number_integer(), "field '{}' must be an integer", name);
  const int64_t v = it->get<int64_t>();
  BG_CHECK(v >= lo && v <= hi, "field '{}' = {} must be in [{}, {}]", name, v, lo, hi);
  return v;
}

std::string string_field(const json& body, const char* name, size_t max_bytes) {
  const auto it = body.find(name);
  BG_CHECK(it != body.end() && it->is_string(), "field '{}' must be a string", name);
  std::string v = it->get<std::string>();
  BG_CHECK(v.size() <= max_bytes, "field '{}' is {} bytes, at most {}", name, v.size(), max_bytes);
  return v;
}

// "rank-<r>-i<n>-<hex>" as WorkerManager makes them: nothing else reaches a command line.
bool plausible_routing_id(const std::string& id, int32_t rank) {
  const std::string prefix = fmt::format("rank-{}-i", rank);
  if (id.size() > static_cast<size_t>(kMaxRoutingIdBytes) || id.rfind(prefix, 0) != 0) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '-';
  });
}

}  // namespace

NodeEndpoints node_endpoints(const std::string& dist_init_addr) {
  BG_CHECK(!dist_init_addr.empty(), "--dist-init-addr HOST:PORT is required with --nnodes > 1 (an address of node 0 "
           "every node reaches, and a free port there)");
  const dist::HostPort hp = dist::parse_host_port(dist_init_addr, "--dist-init-addr");
  BG_CHECK(hp.port <= 65534, "--dist-init-addr '{}': serve uses the port and the next one, so the port must be in "
           "[1, 65534]", dist_init_addr);
  BG_CHECK(!hp.host.empty() && hp.host.size() <= 253 && hp.host.find_first_of(" \t/*;[]") == std::string::npos,
           "--dist-init-addr '{}': '{}' is not a host name or address", dist_init_addr, hp.host);
  BG_CHECK(hp.host.find(':') == std::string::npos, "--dist-init-addr '{}': give an IPv4 address or a host name",
           dist_init_addr);
  NodeEndpoints e;
  e.host = hp.host;
  e.port = hp.port;
  e.control = fmt::format("tcp://{}:{}", hp.host, hp.port);
  e.worker_link = fmt::format("tcp://{}:{}", hp.host, hp.port + 1);
  e.rendezvous_bind = fmt::format("tcp://{}:*", hp.host);
  return e;
}

std::string encode(const std::string& type, const json& body) { return json{{"type", type}, {"body", body}}.dump(); }

ControlMessage decode(const std::string& frame, const std::vector<std::string>& allowed) {
  BG_CHECK(frame.size() <= kMaxFrameBytes, "a message of {} bytes (at most {})", frame.size(), kMaxFrameBytes);
  json j = json::parse(frame, nullptr, /*allow_exceptions=*/false);
  BG_CHECK(j.is_object() && j.contains("type") && j["type"].is_string() && j.contains("body") &&
               j["body"].is_object(),
           "not a control message ({{\"type\": string, \"body\": object}})");
  ControlMessage m;
  m.type = j["type"].get<std::string>();
  BG_CHECK(std::find(allowed.begin(), allowed.end(), m.type) != allowed.end(), "unexpected message type '{}'",
           m.type.substr(0, 32));
  m.body = std::move(j["body"]);
  return m;
}

json to_json(const Hello& h) {
  return json{{"node_rank", h.node_rank}, {"nnodes", h.nnodes}, {"config", h.config}, {"pid", h.pid},
              {"host", h.host}};
}

json to_json(const StartRanks& s) {
  json ranks = json::array();
  for (const auto& [rank, id] : s.ranks) ranks.push_back(json{{"rank", rank}, {"routing_id", id}});
  return json{{"incarnation", s.incarnation}, {"rendezvous", s.rendezvous}, {"ranks", std::move(ranks)}};
}

json to_json(const RankProcess& p) {
  return json{{"incarnation", p.incarnation}, {"rank", p.rank}, {"pid", p.pid}, {"wait_status", p.wait_status}};
}

Hello parse_hello(const json& body) {
  Hello h;
  h.node_rank = static_cast<int32_t>(int_field(body, "node_rank", 0, dist::kMaxRanks));
  h.nnodes = static_cast<int32_t>(int_field(body, "nnodes", 1, dist::kMaxRanks));
  h.config = string_field(body, "config", 1024);
  h.pid = int_field(body, "pid", 1, int64_t{1} << 31);
  h.host = string_field(body, "host", 255);
  return h;
}

StartRanks parse_start(const json& body, int32_t world, int32_t nnodes, int32_t node_rank, const std::string& host) {
  StartRanks s;
  s.incarnation = int_field(body, "incarnation", 1, int64_t{1} << 40);
  s.rendezvous = string_field(body, "rendezvous", 300);
  const std::string prefix = "tcp://" + host + ":";
  const std::string port = s.rendezvous.rfind(prefix, 0) == 0 ? s.rendezvous.substr(prefix.size()) : "";
  BG_CHECK(!port.empty() && port.size() <= 5 && port.find_first_not_of("0123456789") == std::string::npos,
           "rendezvous '{}' is not tcp://{}:PORT", s.rendezvous.substr(0, 80), host);
  const auto it = body.find("ranks");
  const int32_t per_node = world / nnodes, first = node_rank * per_node;
  BG_CHECK(it != body.end() && it->is_array() && it->size() == static_cast<size_t>(per_node),
           "'ranks' must list this node's {} ranks", per_node);
  for (int32_t i = 0; i < per_node; ++i) {
    const json& r = (*it)[static_cast<size_t>(i)];
    BG_CHECK(r.is_object(), "'ranks' entries must be objects");
    const auto rank = static_cast<int32_t>(int_field(r, "rank", 0, world - 1));
    BG_CHECK(rank == first + i, "rank {} is not this node's rank {}", rank, first + i);
    std::string id = string_field(r, "routing_id", static_cast<size_t>(kMaxRoutingIdBytes));
    BG_CHECK(plausible_routing_id(id, rank), "routing id '{}' of rank {} is malformed", id.substr(0, 40), rank);
    s.ranks.emplace_back(rank, std::move(id));
  }
  return s;
}

RankProcess parse_rank_process(const json& body) {
  RankProcess p;
  p.incarnation = int_field(body, "incarnation", 1, int64_t{1} << 40);
  p.rank = static_cast<int32_t>(int_field(body, "rank", 0, dist::kMaxRanks - 1));
  p.pid = int_field(body, "pid", 1, int64_t{1} << 31);
  p.wait_status = static_cast<int32_t>(int_field(body, "wait_status", 0, 0xffff));
  return p;
}

std::string parse_reason(const json& body) { return string_field(body, "reason", 4096); }

}  // namespace bg::frontend::nodes

// Rendezvous server and join over ZeroMQ ROUTER/DEALER; messages are JSON objects {"type", ...}.
#include "dist/rendezvous.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <zmq_addon.hpp>

#include "core/error.h"
#include "core/log.h"

namespace bg::dist {

using json = nlohmann::json;

std::string to_hex(const void* data, size_t n) {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const auto b = static_cast<const uint8_t*>(data)[i];
    s.push_back(kDigits[b >> 4]);
    s.push_back(kDigits[b & 15]);
  }
  return s;
}

std::vector<uint8_t> from_hex(const std::string& hex) {
  auto nibble = [&](char c) -> uint8_t {
    if (c >= '0' && c <= '9') return static_cast<uint8_t>(c - '0');
    if (c >= 'a' && c <= 'f') return static_cast<uint8_t>(c - 'a' + 10);
    fail("rendezvous: '{}' is not lowercase hex", hex.substr(0, 32));
  };
  BG_CHECK(hex.size() % 2 == 0, "rendezvous: odd-length hex");
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  return out;
}

namespace {

constexpr size_t kMaxFrameBytes = 1 << 16;

JoinInfo parse_join(const json& j) {
  BG_CHECK(j.is_object() && j.value("type", "") == "join", "not a join message");
  JoinInfo in;
  in.rank = j.at("rank").get<int32_t>();
  in.world = j.at("world").get<int32_t>();
  in.layout = j.at("layout").get<std::string>();
  in.transport_id = j.at("transport_id").get<std::string>();
  in.plan = j.at("plan").get<std::vector<int64_t>>();
  in.pid = j.value("pid", int64_t{0});
  in.host = j.value("host", std::string());
  BG_CHECK(in.plan.size() <= 64 && in.transport_id.size() <= 4096, "join: oversized fields");
  return in;
}

}  // namespace

RendezvousServer::RendezvousServer(zmq::context_t& ctx, const std::string& endpoint, int32_t world, std::string layout,
                                   const LinkKey* key)
    : sock_(ctx, zmq::socket_type::router), world_(world), layout_(std::move(layout)) {
  BG_CHECK(world >= 1, "rendezvous: world {}", world);
  secure_bind_side(sock_, key);
  sock_.set(zmq::sockopt::linger, 0);
  sock_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxFrameBytes));
  try {
    sock_.bind(endpoint);
  } catch (const zmq::error_t& e) {
    fail("rendezvous: cannot bind {}: {}", endpoint, e.what());
  }
  endpoint_ = sock_.get(zmq::sockopt::last_endpoint);
  joins_.resize(static_cast<size_t>(world));
  identities_.resize(static_cast<size_t>(world));
  thread_ = std::thread([this] { run(); });
}

RendezvousServer::~RendezvousServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

std::vector<bool> RendezvousServer::joined() const {
  std::lock_guard lock(mu_);
  std::vector<bool> out;
  for (const std::string& id : identities_) out.push_back(!id.empty());
  return out;
}

void RendezvousServer::run() {
  zmq::pollitem_t item{sock_.handle(), 0, ZMQ_POLLIN, 0};
  while (!stop_) {
    zmq::poll(&item, 1, std::chrono::milliseconds(100));
    if ((item.revents & ZMQ_POLLIN) == 0) continue;
    std::vector<zmq::message_t> parts;
    while (zmq::recv_multipart(sock_, std::back_inserter(parts), zmq::recv_flags::dontwait)) {
      if (parts.size() == 2) {
        try {
          on_join(parts[0].to_string(), parts[1].to_string());
        } catch (const std::exception& e) {
          log::warn("rendezvous: rejected a join: {}", e.what());
          reply(parts[0].to_string(), "error", json(e.what()).dump());
        }
      }
      parts.clear();
    }
  }
}

void RendezvousServer::reply(const std::string& identity, const std::string& type, const std::string& body_json) {
  const std::string frame = json{{"type", type}, {"body", json::parse(body_json)}}.dump();
  try {
    sock_.send(zmq::buffer(identity), zmq::send_flags::sndmore);
    sock_.send(zmq::buffer(frame), zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    log::warn("rendezvous: reply to a rank failed: {}", e.what());
  }
}

void RendezvousServer::on_join(const std::string& identity, const std::string& frame) {
  const JoinInfo in = parse_join(json::parse(frame));
  BG_CHECK(in.world == world_, "rank {} was started for {} ranks, this set has {}", in.rank, in.world, world_);
  BG_CHECK(in.rank >= 0 && in.rank < world_, "rank {} is outside [0, {})", in.rank, world_);
  BG_CHECK(in.layout == layout_, "rank {} has layout '{}', the set '{}'", in.rank, in.layout, layout_);
  std::vector<std::pair<std::string, std::string>> replies;
  {
    std::lock_guard lock(mu_);
    BG_CHECK(!complete_, "rank {} joined a set that is already complete", in.rank);
    std::string& id = identities_[static_cast<size_t>(in.rank)];
    BG_CHECK(id.empty() || id == identity, "rank {} joined twice", in.rank);
    BG_CHECK(in.rank != 0 || !in.transport_id.empty(), "rank 0 joined without a transport id");
    for (size_t r = 0; r < joins_.size(); ++r) {
      BG_CHECK(identities_[r].empty() || joins_[r].plan.size() == in.plan.size(), "rank {} sent {} plan numbers, "
               "rank {} sent {}", in.rank, in.plan.size(), r, joins_[r].plan.size());
    }
    id = identity;
    joins_[static_cast<size_t>(in.rank)] = in;
    log::info("rendezvous: rank {} joined (pid {} on {})", in.rank, in.pid, in.host);
    if (std::any_of(identities_.begin(), identities_.end(), [](const std::string& s) { return s.empty(); })) return;
    std::vector<int64_t> plan = joins_[0].plan;
    for (const JoinInfo& j : joins_) {
      for (size_t i = 0; i < plan.size(); ++i) plan[i] = std::min(plan[i], j.plan[i]);
    }
    const std::string body = json{{"transport_id", joins_[0].transport_id}, {"plan", plan}}.dump();
    for (const std::string& i : identities_) replies.emplace_back(i, body);
    complete_ = true;
  }
  for (const auto& [i, body] : replies) reply(i, "world", body);
  log::info("rendezvous: all {} ranks joined", world_);
}

WorldInfo rendezvous_join(zmq::context_t& ctx, const std::string& endpoint, const JoinInfo& me, double timeout_s,
                          const std::function<bool()>& abandon, const LinkKey* key) {
  zmq::socket_t sock(ctx, zmq::socket_type::dealer);
  secure_connect_side(sock, key);
  sock.set(zmq::sockopt::linger, 0);
  sock.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxFrameBytes));
  try {
    sock.connect(endpoint);
  } catch (const zmq::error_t& e) {
    fail("rank {}: cannot connect to the rendezvous {}: {}", me.rank, endpoint, e.what());
  }
  const json j = {{"type", "join"}, {"rank", me.rank}, {"world", me.world}, {"layout", me.layout},
                  {"transport_id", me.transport_id}, {"plan", me.plan}, {"pid", me.pid}, {"host", me.host}};
  sock.send(zmq::buffer(j.dump()), zmq::send_flags::none);
  const auto start = std::chrono::steady_clock::now();
  zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
  for (;;) {
    zmq::poll(&item, 1, std::chrono::milliseconds(100));
    if (item.revents & ZMQ_POLLIN) {
      zmq::message_t msg;
      if (!sock.recv(msg, zmq::recv_flags::dontwait)) continue;
      const json r = json::parse(msg.to_string(), nullptr, false);
      BG_CHECK(r.is_object() && r.contains("type") && r.contains("body"), "rank {}: malformed rendezvous reply",
               me.rank);
      if (r["type"] == "error") fail("rank {}: the rendezvous rejected this rank: {}", me.rank, r["body"].dump());
      BG_CHECK(r["type"] == "world", "rank {}: unexpected rendezvous reply '{}'", me.rank, r["type"].dump());
      WorldInfo w;
      w.transport_id = r["body"].at("transport_id").get<std::string>();
      w.plan = r["body"].at("plan").get<std::vector<int64_t>>();
      return w;
    }
    if (abandon && abandon()) fail("rank {}: stopped while waiting for the other ranks to join", me.rank);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const char* hint = key != nullptr ? " (does every node hold the same --node-secret-file?)" : "";
    BG_CHECK(waited < timeout_s, "rank {}: the other ranks did not join the rendezvous at {} within {:.0f} s{}",
             me.rank, endpoint, timeout_s, hint);
  }
}

}  // namespace bg::dist

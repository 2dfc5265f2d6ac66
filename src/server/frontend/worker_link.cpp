// The ROUTER thread: command forwarding, event routing, status/readiness bookkeeping.
#include "server/frontend/worker_link.h"

#include <fmt/format.h>

#include <zmq_addon.hpp>

#include <algorithm>

#include "core/error.h"
#include "core/log.h"
#include "server/frontend/api_error.h"

namespace bg::frontend {

using Clock = std::chrono::steady_clock;

void RequestEvents::push(proto::TokenEvent ev) {
  {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(ev));
  }
  cv_.notify_one();
}

std::optional<proto::TokenEvent> RequestEvents::pop(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  proto::TokenEvent ev = std::move(events_.front());
  events_.pop_front();
  return ev;
}

std::string RankState::not_ready_reason() const {
  if (!process_alive) return exit_reason.empty() ? "the worker process exited" : exit_reason;
  if (!connected) return "the worker has not connected yet";
  if (status.phase == "failed") return "the worker failed: " + status.error;
  if (status.phase != "ready") return "the worker is " + status.phase;
  return "";
}

namespace {

std::string rank_identity(int32_t rank) { return fmt::format("rank-{}", rank); }

std::optional<int32_t> parse_identity(const std::string& id) {
  if (id.rfind("rank-", 0) != 0 || id.size() == 5 || id.size() > 12) return std::nullopt;
  int64_t r = 0;
  for (size_t i = 5; i < id.size(); ++i) {
    if (id[i] < '0' || id[i] > '9') return std::nullopt;
    r = r * 10 + (id[i] - '0');
  }
  return static_cast<int32_t>(r);
}

proto::TokenEvent error_event(const std::string& id, const std::string& reason, int32_t code) {
  proto::TokenEvent ev;
  ev.id = id;
  ev.finish_reason = "error";
  ev.error = reason;
  ev.error_code = code;
  return ev;
}

}  // namespace

WorkerLink::WorkerLink(zmq::context_t& ctx, const std::string& endpoint, int32_t n_ranks, int32_t tp)
    : ctx_(ctx),
      endpoint_(endpoint),
      cmd_endpoint_(fmt::format("inproc://bg-frontend-cmd-{}", static_cast<const void*>(this))),
      router_(ctx, zmq::socket_type::router),
      cmd_pull_(ctx, zmq::socket_type::pull),
      cmd_push_(ctx, zmq::socket_type::push),
      last_status_(static_cast<size_t>(n_ranks), Clock::now()),
      in_flight_(static_cast<size_t>(n_ranks), 0),
      in_flight_tokens_(static_cast<size_t>(n_ranks), 0),
      tp_(tp) {
  BG_CHECK(n_ranks >= 1 && tp >= 1 && n_ranks % tp == 0, "WorkerLink: {} ranks in groups of {}", n_ranks, tp);
  for (int32_t r = 0; r < n_ranks; ++r) {
    RankState s;
    s.rank = r;
    s.status.rank = r;
    ranks_.push_back(s);
  }
  router_.set(zmq::sockopt::linger, 0);
  router_.set(zmq::sockopt::router_mandatory, 1);
  router_.set(zmq::sockopt::router_handover, 1);  // a restarted rank takes its routing id over at once
  router_.bind(endpoint_);
  cmd_pull_.set(zmq::sockopt::linger, 0);
  cmd_pull_.bind(cmd_endpoint_);
  cmd_push_.set(zmq::sockopt::linger, 0);
  cmd_push_.connect(cmd_endpoint_);
}

WorkerLink::~WorkerLink() { stop(); }

void WorkerLink::start() { thread_ = std::thread([this] { run(); }); }

void WorkerLink::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void WorkerLink::send_command(int32_t rank, const std::string& frame) {
  std::lock_guard lock(cmd_mu_);
  const std::string id = rank_identity(rank);
  cmd_push_.send(zmq::buffer(id), zmq::send_flags::sndmore);
  cmd_push_.send(zmq::buffer(frame), zmq::send_flags::none);
}

std::shared_ptr<RequestEvents> WorkerLink::submit(const proto::GenerateRequest& req) {
  auto events = std::make_shared<RequestEvents>();
  int32_t rank = -1;
  const int64_t tokens = static_cast<int64_t>(req.prompt.size()) + req.params.max_tokens;
  {
    std::lock_guard lock(mu_);
    std::string why;
    for (const RankState& s : ranks_) {  // a rank set steps together: every rank must be ready
      if (!s.ready() && why.empty()) why = fmt::format("rank {} is not ready: {}", s.rank, s.not_ready_reason());
    }
    if (why.empty()) {
      for (int32_t r = 0; r < static_cast<int32_t>(ranks_.size()); r += tp_) {
        if (rank < 0 || load_of(r) < load_of(rank)) rank = r;
      }
    }
    if (rank < 0) throw ApiError(503, "the model is not ready to serve: " + why, "", "model_not_ready");
    BG_CHECK(live_.count(req.id) == 0, "duplicate request id {}", req.id);
    live_[req.id] = Live{rank, tokens, events};
    ++in_flight_[static_cast<size_t>(rank)];
    in_flight_tokens_[static_cast<size_t>(rank)] += tokens;
  }
  send_command(rank, proto::encode("generate", req));
  return events;
}

double WorkerLink::load_of(int32_t rank) const {
  const proto::WorkerStatus& st = ranks_[static_cast<size_t>(rank)].status;
  const auto frac = [](int64_t total, int64_t free) {
    return total > 0 ? static_cast<double>(total - free) / static_cast<double>(total) : 0.0;
  };
  const int64_t capacity = std::max<int64_t>(1, st.kv_blocks_total * st.kv_block_tokens);
  const double tokens = static_cast<double>(in_flight_tokens_[static_cast<size_t>(rank)]) / static_cast<double>(capacity);
  return tokens + std::max(frac(st.kv_blocks_total, st.kv_blocks_free), frac(st.state_slots_total, st.state_slots_free));
}

void WorkerLink::cancel(const std::string& id) {
  int32_t rank = -1;
  {
    std::lock_guard lock(mu_);
    auto it = live_.find(id);
    if (it == live_.end()) return;
    rank = it->second.rank;
  }
  send_command(rank, proto::encode("cancel", proto::Cancel{id}));
}

void WorkerLink::shutdown_workers() {
  for (size_t r = 0; r < in_flight_.size(); ++r) {
    send_command(static_cast<int32_t>(r), proto::encode("shutdown", nlohmann::json::object()));
  }
}

void WorkerLink::fail_rank_requests(int32_t rank, const std::string& reason, int32_t code) {
  std::lock_guard lock(mu_);
  for (auto it = live_.begin(); it != live_.end();) {
    if (rank < 0 || it->second.rank == rank) {
      it->second.events->push(error_event(it->first, reason, code));
      it = live_.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t r = 0; r < in_flight_.size(); ++r) {
    if (rank < 0 || static_cast<int32_t>(r) == rank) in_flight_[r] = in_flight_tokens_[r] = 0;
  }
}

void WorkerLink::reset_ranks() {
  std::lock_guard lock(mu_);
  for (size_t r = 0; r < ranks_.size(); ++r) {
    RankState s;
    s.rank = static_cast<int32_t>(r);
    s.status.rank = s.rank;
    ranks_[r] = s;
    last_status_[r] = Clock::now();
  }
}

void WorkerLink::mark_exited(int32_t rank, const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (rank < 0 || rank >= static_cast<int32_t>(ranks_.size())) return;
    ranks_[static_cast<size_t>(rank)].process_alive = false;
    ranks_[static_cast<size_t>(rank)].exit_reason = reason;
  }
  // With several ranks nobody can step without this one: every request fails.
  fail_rank_requests(ranks_.size() > 1 ? -1 : rank, fmt::format("rank {}: {}", rank, reason), 503);
}

void WorkerLink::on_worker_message(const std::string& identity, const std::string& frame) {
  std::optional<int32_t> rank = parse_identity(identity);
  if (!rank || *rank >= static_cast<int32_t>(ranks_.size())) {
    log::warn("frontend: message from unknown peer '{}' ignored", identity);
    return;
  }
  proto::Message m = proto::decode(std::as_bytes(std::span(frame.data(), frame.size())));
  const auto r = static_cast<size_t>(*rank);
  if (m.type == "status") {
    auto st = proto::body_as<proto::WorkerStatus>(m);
    std::string failed;
    {
      std::lock_guard lock(mu_);
      RankState& s = ranks_[r];
      if (s.status.phase != st.phase || !s.connected) {
        log::info("frontend: rank {} is {}{}", *rank, st.phase, st.error.empty() ? "" : ": " + st.error);
      }
      if (st.phase == "failed" && s.status.phase != "failed") failed = st.error;
      s.connected = true;
      s.status = std::move(st);
      s.status.rank = *rank;
      last_status_[r] = Clock::now();
    }
    if (!failed.empty()) {
      fail_rank_requests(ranks_.size() > 1 ? -1 : *rank, fmt::format("rank {} failed: {}", *rank, failed), 503);
    }
  } else if (m.type == "tokens") {
    auto ev = proto::body_as<proto::TokenEvent>(m);
    std::lock_guard lock(mu_);
    auto it = live_.find(ev.id);
    if (it == live_.end()) return;  // already failed locally
    const bool final = !ev.finish_reason.empty();
    auto events = it->second.events;
    if (final) {
      in_flight_tokens_[r] = std::max<int64_t>(0, in_flight_tokens_[r] - it->second.tokens);
      live_.erase(it);
      if (--in_flight_[r] <= 0) {
        in_flight_[r] = 0;
        // Refresh the status at once so /metrics shows the freed blocks without waiting for the periodic one.
        router_.send(zmq::buffer(identity), zmq::send_flags::sndmore);
        router_.send(zmq::buffer(proto::encode("status_request", nlohmann::json::object())), zmq::send_flags::none);
      }
    }
    events->push(std::move(ev));
  } else {
    log::warn("frontend: unexpected '{}' message from {}", m.type, identity);
  }
}

void WorkerLink::run() {
  std::vector<zmq::pollitem_t> items = {{router_.handle(), 0, ZMQ_POLLIN, 0}, {cmd_pull_.handle(), 0, ZMQ_POLLIN, 0}};
  while (!stop_) {
    zmq::poll(items, std::chrono::milliseconds(100));
    try {
      if (items[0].revents & ZMQ_POLLIN) {
        std::vector<zmq::message_t> parts;
        while (zmq::recv_multipart(router_, std::back_inserter(parts), zmq::recv_flags::dontwait)) {
          if (parts.size() == 2) on_worker_message(parts[0].to_string(), parts[1].to_string());
          parts.clear();
        }
      }
      if (items[1].revents & ZMQ_POLLIN) {
        std::vector<zmq::message_t> parts;
        while (zmq::recv_multipart(cmd_pull_, std::back_inserter(parts), zmq::recv_flags::dontwait)) {
          forward_command(parts[0].to_string(), parts[1].to_string());
          parts.clear();
        }
      }
    } catch (const std::exception& e) {
      log::error("frontend: worker link: {}", e.what());
    }
  }
}

void WorkerLink::forward_command(const std::string& identity, const std::string& frame) {
  try {
    router_.send(zmq::buffer(identity), zmq::send_flags::sndmore);
    router_.send(zmq::buffer(frame), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    // The worker is not connected (ROUTER_MANDATORY): fail a generate at once instead of losing it.
    proto::Message m = proto::decode(std::as_bytes(std::span(frame.data(), frame.size())));
    if (m.type != "generate") return;
    const std::string id = m.body.value("id", std::string());
    std::lock_guard lock(mu_);
    auto it = live_.find(id);
    if (it == live_.end()) return;
    it->second.events->push(error_event(id, fmt::format("{} is not connected: {}", identity, e.what()), 503));
    --in_flight_[static_cast<size_t>(it->second.rank)];
    in_flight_tokens_[static_cast<size_t>(it->second.rank)] -= it->second.tokens;
    live_.erase(it);
  }
}

std::vector<RankState> WorkerLink::ranks() const {
  std::lock_guard lock(mu_);
  std::vector<RankState> out = ranks_;
  const auto now = Clock::now();
  for (size_t r = 0; r < out.size(); ++r) {
    out[r].status_age_s = std::chrono::duration<double>(now - last_status_[r]).count();
  }
  return out;
}

std::vector<proto::WorkerStatus> WorkerLink::statuses() const {
  std::lock_guard lock(mu_);
  std::vector<proto::WorkerStatus> out;
  for (const RankState& s : ranks_) out.push_back(s.status);
  return out;
}

bool WorkerLink::all_ready() const {
  std::lock_guard lock(mu_);
  for (const RankState& s : ranks_) {
    if (!s.ready()) return false;
  }
  return true;
}

int64_t WorkerLink::max_model_len() const {
  std::lock_guard lock(mu_);
  int64_t len = 0;
  for (const RankState& s : ranks_) {
    if (s.ready() && (len == 0 || s.status.max_model_len < len)) len = s.status.max_model_len;
  }
  return len;
}

}  // namespace bg::frontend

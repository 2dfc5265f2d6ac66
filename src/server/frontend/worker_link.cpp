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
  std::function<void()> notify;
  {
    std::lock_guard lock(mu_);
    events_.push_back(std::move(ev));
    notify = notify_;
  }
  cv_.notify_one();
  if (notify) notify();
}

void RequestEvents::set_notify(std::function<void()> notify) {
  std::lock_guard lock(mu_);
  notify_ = std::move(notify);
}

std::optional<proto::TokenEvent> RequestEvents::pop(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  proto::TokenEvent ev = std::move(events_.front());
  events_.pop_front();
  return ev;
}

std::string RankState::state() const {
  if (gave_up) return "gave_up";
  if (!process_alive) return supervisor_note.empty() ? "exited" : "restarting";
  if (status.phase == "failed") return "failed";
  if (!heartbeat_ok()) return "hung";
  if (!connected) return "starting";
  return status.phase;
}

std::string RankState::name() const {
  return node < 0 ? fmt::format("rank {}", rank) : fmt::format("rank {} (node {})", rank, node);
}

std::string RankState::not_ready_reason() const {
  std::string why;
  if (!process_alive) {
    why = exit_reason.empty() ? "the worker process exited" : exit_reason;
  } else if (status.phase == "failed") {
    why = "the worker failed: " + status.error;
  } else if (!heartbeat_ok()) {
    why = fmt::format("the worker stopped responding (no heartbeat for {:.1f} s, limit {:.1f} s)", status_age_s,
                      heartbeat_timeout_s);
  } else if (!connected) {
    why = "the worker has not connected yet";
  } else if (status.phase != "ready") {
    why = "the worker is " + status.phase;
  }
  if (!supervisor_note.empty()) why += (why.empty() ? "" : "; ") + supervisor_note;
  return why;
}

namespace {

std::string rank_identity(int32_t rank) { return fmt::format("rank-{}", rank); }

proto::TokenEvent error_event(const std::string& id, const std::string& reason, int32_t code) {
  proto::TokenEvent ev;
  ev.id = id;
  ev.finish_reason = "error";
  ev.error = reason;
  ev.error_code = code;
  return ev;
}

}  // namespace

WorkerLink::WorkerLink(zmq::context_t& ctx, const std::string& endpoint, int32_t n_ranks, int32_t tp,
                       const dist::LinkKey* key)
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
  BG_CHECK(n_ranks >= 1, "WorkerLink: n_ranks {} must be >= 1", n_ranks);
  for (int32_t r = 0; r < n_ranks; ++r) {
    RankState s;
    s.rank = r;
    s.identity = rank_identity(r);
    s.status.rank = r;
    ranks_.push_back(s);
  }
  dist::secure_bind_side(router_, key);
  router_.set(zmq::sockopt::linger, 0);
  router_.set(zmq::sockopt::router_mandatory, 1);  // a send to a peer that is not connected fails, never vanishes
  if (endpoint.rfind("tcp://", 0) == 0) {
    // Across nodes anyone on the network can connect: a frame larger than any worker message drops its sender.
    router_.set(zmq::sockopt::maxmsgsize, int64_t{64} << 20);
  }
  try {
    router_.bind(endpoint_);
  } catch (const zmq::error_t& e) {
    fail("serve: cannot bind the worker link {}: {}", endpoint_, e.what());
  }
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
  std::string id;
  {
    std::lock_guard lock(mu_);
    id = ranks_[static_cast<size_t>(rank)].identity;
  }
  std::lock_guard lock(cmd_mu_);
  cmd_push_.send(zmq::buffer(id), zmq::send_flags::sndmore);
  cmd_push_.send(zmq::buffer(frame), zmq::send_flags::none);
}

std::shared_ptr<RequestEvents> WorkerLink::submit(const proto::GenerateRequest& req) {
  auto events = std::make_shared<RequestEvents>();
  int32_t rank = -1;
  {
    std::lock_guard lock(mu_);
    std::string why;
    const auto now = Clock::now();
    for (size_t r = 0; r < ranks_.size(); ++r) {
      if (!ready_locked(r, now)) {
        if (ranks_.size() > 1) rank = -2;  // a rank set steps together: no request until every rank is ready
        if (why.empty()) {
          RankState s = ranks_[r];
          s.status_age_s = std::chrono::duration<double>(now - last_status_[r]).count();
          why = fmt::format("{} is not ready: {}", s.name(), s.not_ready_reason());
        }
        continue;
      }
      if (r % static_cast<size_t>(tp_) != 0 || rank == -2) continue;  // only DP group leaders schedule
      if (rank < 0 || load_of(r) < load_of(static_cast<size_t>(rank))) rank = static_cast<int32_t>(r);
    }
    if (rank < 0) throw ApiError(503, "the model is not ready to serve: " + why, "", "model_not_ready");
    BG_CHECK(live_.count(req.id) == 0, "duplicate request id {}", req.id);
    const int64_t tokens = static_cast<int64_t>(req.prompt.size()) + req.params.max_tokens;
    live_[req.id] = Live{rank, tokens, events};
    ++in_flight_[static_cast<size_t>(rank)];
    in_flight_tokens_[static_cast<size_t>(rank)] += tokens;
  }
  send_command(rank, proto::encode("generate", req));
  return events;
}

double WorkerLink::load_of(size_t rank) const {
  const proto::WorkerStatus& st = ranks_[rank].status;
  const auto used = [](int64_t total, int64_t free) {
    return total > 0 ? static_cast<double>(total - free) / static_cast<double>(total) : 0.0;
  };
  const double capacity = static_cast<double>(std::max<int64_t>(1, st.kv_blocks_total * st.kv_block_tokens));
  return static_cast<double>(in_flight_tokens_[rank]) / capacity +
         std::max(used(st.kv_blocks_total, st.kv_blocks_free), used(st.state_slots_total, st.state_slots_free));
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
  for (size_t r = 0; r < ranks_.size(); ++r) {
    send_command(static_cast<int32_t>(r), proto::encode("shutdown", nlohmann::json::object()));
  }
}

void WorkerLink::fail_requests_locked(int32_t rank, const std::string& reason, int32_t code) {
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

void WorkerLink::fail_rank_requests(int32_t rank, const std::string& reason, int32_t code) {
  std::lock_guard lock(mu_);
  fail_requests_locked(rank, reason, code);
}

void WorkerLink::fail_all(const std::string& reason, int32_t code) {
  std::lock_guard lock(mu_);
  fail_requests_locked(-1, reason, code);
}

void WorkerLink::mark_exited(int32_t rank, const std::string& reason) {
  {
    std::lock_guard lock(mu_);
    if (rank < 0 || rank >= static_cast<int32_t>(ranks_.size())) return;
    ranks_[static_cast<size_t>(rank)].process_alive = false;
    ranks_[static_cast<size_t>(rank)].exit_reason = reason;
  }
  // With several ranks nobody can step without this one: every request fails.
  fail_rank_requests(ranks_.size() > 1 ? -1 : rank,
                     fmt::format("{}: {}", ranks_[static_cast<size_t>(rank)].name(), reason), 503);
}

void WorkerLink::begin_incarnation(int32_t rank, const std::string& identity, int64_t pid) {
  std::lock_guard lock(mu_);
  BG_CHECK(rank >= 0 && rank < static_cast<int32_t>(ranks_.size()), "worker link: rank {} out of range", rank);
  RankState& s = ranks_[static_cast<size_t>(rank)];
  s.identity = identity;
  s.pid = pid;
  s.connected = false;
  s.process_alive = true;
  s.status = proto::WorkerStatus{};
  s.status.rank = rank;
  last_status_[static_cast<size_t>(rank)] = Clock::now();
}

void WorkerLink::set_pid(int32_t rank, int64_t pid) {
  std::lock_guard lock(mu_);
  if (rank >= 0 && rank < static_cast<int32_t>(ranks_.size())) ranks_[static_cast<size_t>(rank)].pid = pid;
}

void WorkerLink::set_ranks_per_node(int32_t ranks_per_node) {
  BG_CHECK(ranks_per_node >= 1, "worker link: {} ranks per node", ranks_per_node);
  std::lock_guard lock(mu_);
  for (RankState& s : ranks_) s.node = s.rank / ranks_per_node;
}

void WorkerLink::restart_clock(int32_t rank) {
  std::lock_guard lock(mu_);
  if (rank < 0 || rank >= static_cast<int32_t>(ranks_.size())) return;
  if (!ranks_[static_cast<size_t>(rank)].connected) last_status_[static_cast<size_t>(rank)] = Clock::now();
}

void WorkerLink::set_supervisor_note(int32_t rank, const std::string& note, bool gave_up) {
  std::lock_guard lock(mu_);
  if (rank < 0 || rank >= static_cast<int32_t>(ranks_.size())) return;
  ranks_[static_cast<size_t>(rank)].supervisor_note = note;
  ranks_[static_cast<size_t>(rank)].gave_up = gave_up;
}

void WorkerLink::count_restart() {
  std::lock_guard lock(mu_);
  ++restarts_;
}

void WorkerLink::set_heartbeat_timeout(std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  heartbeat_timeout_ = timeout;
}

size_t WorkerLink::n_in_flight() const {
  std::lock_guard lock(mu_);
  return live_.size();
}

std::optional<int32_t> WorkerLink::rank_of(const std::string& identity) const {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r].identity == identity) return static_cast<int32_t>(r);
  }
  return std::nullopt;
}

bool WorkerLink::ready_locked(size_t r, Clock::time_point now) const {
  const RankState& s = ranks_[r];
  return s.process_alive && s.connected && s.status.phase == "ready" && now - last_status_[r] <= heartbeat_timeout_;
}

void WorkerLink::warn_dropped(const std::string& what) {
  // Called with mu_ held; at most one line a second (a confused peer could send many).
  ++n_dropped_;
  const auto now = Clock::now();
  if (now - last_drop_log_ < std::chrono::seconds(1)) return;
  last_drop_log_ = now;
  log::warn("frontend: dropped {} ({} message(s) dropped so far)", what, n_dropped_);
}

void WorkerLink::on_worker_message(const std::string& identity, const std::string& frame) {
  std::optional<int32_t> rank;
  {
    std::lock_guard lock(mu_);
    rank = rank_of(identity);
    if (!rank) {
      // An earlier incarnation's last words, or a peer that is not ours: never attributed to a current rank.
      warn_dropped(fmt::format("a message from '{}', which is not a current worker", identity.substr(0, 64)));
      return;
    }
  }
  proto::Message m = proto::decode(std::as_bytes(std::span(frame.data(), frame.size())));
  const auto r = static_cast<size_t>(*rank);
  if (m.type == "status") {
    auto st = proto::body_as<proto::WorkerStatus>(m);
    std::string failed;
    {
      std::lock_guard lock(mu_);
      if (st.rank != *rank) {
        warn_dropped(fmt::format("a status claiming rank {} from {}", st.rank, identity));
        return;
      }
      RankState& s = ranks_[r];
      if (s.status.phase != st.phase || !s.connected) {
        log::info("frontend: rank {} is {}{}", *rank, st.phase, st.error.empty() ? "" : ": " + st.error);
      }
      if (st.phase == "failed" && s.status.phase != "failed") failed = st.error;
      s.connected = true;
      s.status = std::move(st);
      last_status_[r] = Clock::now();
    }
    if (!failed.empty()) fail_rank_requests(*rank, fmt::format("rank {} failed: {}", *rank, failed), 503);
  } else if (m.type == "tokens") {
    auto ev = proto::body_as<proto::TokenEvent>(m);
    std::lock_guard lock(mu_);
    auto it = live_.find(ev.id);
    if (it == live_.end()) return;  // already failed or cancelled locally
    if (it->second.rank != *rank) {
      warn_dropped(fmt::format("a token event for {} from rank {}, which the request was not sent to", ev.id, *rank));
      return;
    }
    last_status_[r] = std::max(last_status_[r], Clock::now());  // tokens are a sign of life too
    const bool final = !ev.finish_reason.empty();
    auto events = it->second.events;
    bool idle = false;
    if (final) {
      in_flight_tokens_[r] = std::max<int64_t>(0, in_flight_tokens_[r] - it->second.tokens);
      live_.erase(it);
      if (--in_flight_[r] <= 0) {
        in_flight_[r] = 0;
        idle = true;
      }
    }
    events->push(std::move(ev));
    // Refresh the status at once so /metrics shows the freed blocks without waiting for the periodic one.
    if (idle) send_to(identity, proto::encode("status_request", nlohmann::json::object()));
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

// Never blocks the router thread: a worker that is gone, or so far behind that its queue is full (a stopped
// process), makes the send fail instead.
bool WorkerLink::send_to(const std::string& identity, const std::string& frame) {
  try {
    if (!router_.send(zmq::buffer(identity), zmq::send_flags::sndmore | zmq::send_flags::dontwait)) return false;
    router_.send(zmq::buffer(frame), zmq::send_flags::dontwait);  // the rest of a message follows its first part
    return true;
  } catch (const zmq::error_t&) {
    return false;  // EHOSTUNREACH: not connected (ROUTER_MANDATORY)
  }
}

void WorkerLink::forward_command(const std::string& identity, const std::string& frame) {
  if (send_to(identity, frame)) return;
  // Fail a generate at once instead of losing it (a lost cancel or status request only costs work).
  proto::Message m = proto::decode(std::as_bytes(std::span(frame.data(), frame.size())));
  if (m.type != "generate") return;
  const std::string id = m.body.value("id", std::string());
  std::lock_guard lock(mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return;
  it->second.events->push(error_event(id, fmt::format("{} is not connected or not reading its messages", identity),
                                      503));
  --in_flight_[static_cast<size_t>(it->second.rank)];
  in_flight_tokens_[static_cast<size_t>(it->second.rank)] -= it->second.tokens;
  live_.erase(it);
}

std::vector<RankState> WorkerLink::ranks() const {
  std::lock_guard lock(mu_);
  std::vector<RankState> out = ranks_;
  const auto now = Clock::now();
  for (size_t r = 0; r < out.size(); ++r) {
    out[r].status_age_s = std::chrono::duration<double>(now - last_status_[r]).count();
    out[r].heartbeat_timeout_s = std::chrono::duration<double>(heartbeat_timeout_).count();
    out[r].restarts = restarts_;
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
  const auto now = Clock::now();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (!ready_locked(r, now)) return false;
  }
  return true;
}

int64_t WorkerLink::max_model_len() const {
  std::lock_guard lock(mu_);
  int64_t len = 0;
  const auto now = Clock::now();
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const int64_t l = ranks_[r].status.max_model_len;
    if (ready_locked(r, now) && (len == 0 || l < len)) len = l;
  }
  return len;
}

}  // namespace bg::frontend

// The frontend's side of the worker protocol: one thread owns the ZeroMQ ROUTER socket (sockets are not thread-safe),
// forwards commands that other threads queue through an inproc PUSH/PULL pair, routes "tokens" events to
// per-request queues and keeps each rank's latest status, heartbeat age and readiness. Messages are accepted only
// from the routing id of each rank's current incarnation, and a token event only from the rank its request went to.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "dist/link_key.h"
#include "server/frontend/rank_state.h"
#include "server/protocol.h"

namespace bg::frontend {

// Events of one request, filled by the router thread, drained by the connection that answers the request.
class RequestEvents {
 public:
  void push(proto::TokenEvent ev);
  // Waits up to `timeout` (0: not at all) for an event; nullopt on timeout.
  std::optional<proto::TokenEvent> pop(std::chrono::milliseconds timeout);
  // Called after every push, outside the lock (it must not block). Events already queued are not re-announced.
  void set_notify(std::function<void()> notify);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<proto::TokenEvent> events_;
  std::function<void()> notify_;
};

class WorkerLink {
 public:
  // Binds the ROUTER on `endpoint` (e.g. "ipc:///tmp/bg-x/router.sock"); n_ranks workers are expected, rank r with
  // routing id "rank-<r>" until begin_incarnation says otherwise.
  // With several ranks they form DP groups of `tp` consecutive ranks; each group's first rank (its leader) takes the
  // group's requests.
  // `key`: the node secret's (link_key.h): only workers holding it can connect.
  WorkerLink(zmq::context_t& ctx, const std::string& endpoint, int32_t n_ranks, int32_t tp = 1,
             const dist::LinkKey* key = nullptr);
  ~WorkerLink();
  WorkerLink(const WorkerLink&) = delete;
  WorkerLink& operator=(const WorkerLink&) = delete;

  void start();
  void stop();

  // Registers the request and sends it to the least-loaded DP group leader (tokens in flight relative to its KV
  // capacity plus its KV / state use). With several ranks every rank must be ready. Throws ApiError(503) otherwise.
  std::shared_ptr<RequestEvents> submit(const proto::GenerateRequest& req);
  // Tells the worker to drop the request; its final ("abort") event is still routed to the queue if it is alive.
  void cancel(const std::string& id);
  // Asks every rank to shut down cleanly.
  void shutdown_workers();

  // From the supervisor. A new process of `rank` with this routing id: only its messages are accepted from now on,
  // and its state starts over (not connected, heartbeat age counted from now).
  void begin_incarnation(int32_t rank, const std::string& identity, int64_t pid);
  void set_pid(int32_t rank, int64_t pid);
  // The set spans nodes of `ranks_per_node` ranks each: ranks are named with their node.
  void set_ranks_per_node(int32_t ranks_per_node);
  // A rank that has not connected yet gets its connect deadline counted from now (its node's agent just started it).
  void restart_clock(int32_t rank);
  // The rank's process has exited; its in-flight requests fail with `reason` (503).
  void mark_exited(int32_t rank, const std::string& reason);
  // Every in-flight request fails with `reason` (the worker set is being restarted).
  void fail_all(const std::string& reason, int32_t code);
  void set_supervisor_note(int32_t rank, const std::string& note, bool gave_up);
  void count_restart();
  void set_heartbeat_timeout(std::chrono::milliseconds timeout);
  // Requests in flight at the workers.
  size_t n_in_flight() const;

  std::vector<RankState> ranks() const;
  std::vector<proto::WorkerStatus> statuses() const;
  bool all_ready() const;
  // The model limits reported by the ready workers (0 before the first status).
  int64_t max_model_len() const;

 private:
  struct Live {
    int32_t rank = 0;
    int64_t tokens = 0;  // prompt + max_tokens: what it may still hold in its group's KV
    std::shared_ptr<RequestEvents> events;
  };
  double load_of(size_t rank) const;  // mu_ held

  void run();
  void send_command(int32_t rank, const std::string& frame);
  void on_worker_message(const std::string& identity, const std::string& frame);
  void forward_command(const std::string& identity, const std::string& frame);
  bool send_to(const std::string& identity, const std::string& frame);
  void fail_rank_requests(int32_t rank, const std::string& reason, int32_t code);
  void fail_requests_locked(int32_t rank, const std::string& reason, int32_t code);  // rank -1: all
  std::optional<int32_t> rank_of(const std::string& identity) const;                  // mu_ held
  bool ready_locked(size_t r, std::chrono::steady_clock::time_point now) const;
  void warn_dropped(const std::string& what);

  zmq::context_t& ctx_;
  std::string endpoint_;
  std::string cmd_endpoint_;
  zmq::socket_t router_;
  zmq::socket_t cmd_pull_;
  std::mutex cmd_mu_;
  zmq::socket_t cmd_push_;           // guarded by cmd_mu_
  std::thread thread_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;            // guards everything below
  std::vector<RankState> ranks_;
  std::vector<std::chrono::steady_clock::time_point> last_status_;
  std::map<std::string, Live> live_;
  std::vector<int64_t> in_flight_;   // per rank
  std::vector<int64_t> in_flight_tokens_;  // per rank
  int32_t tp_ = 1;
  std::chrono::milliseconds heartbeat_timeout_{60000};
  int64_t restarts_ = 0;
  int64_t n_dropped_ = 0;            // messages dropped (unknown sender, wrong rank), for rate-limited logging
  std::chrono::steady_clock::time_point last_drop_log_;
};

}  // namespace bg::frontend

// The frontend's side of the worker protocol: one thread owns the ZeroMQ ROUTER socket (sockets are not thread-safe),
// forwards commands that handler threads queue through an inproc PUSH/PULL pair, routes "tokens" events to
// per-request queues and keeps each rank's latest status and readiness.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "server/protocol.h"

namespace bg::frontend {

// Events of one request, filled by the router thread, drained by the handler thread.
class RequestEvents {
 public:
  void push(proto::TokenEvent ev);
  // Waits up to `timeout` for an event; nullopt on timeout.
  std::optional<proto::TokenEvent> pop(std::chrono::milliseconds timeout);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<proto::TokenEvent> events_;
};

// What /ready and /health report about one rank.
struct RankState {
  int32_t rank = 0;
  bool connected = false;        // a status message has arrived
  bool process_alive = true;     // the worker manager has not seen it exit
  std::string exit_reason;       // why the process is gone
  proto::WorkerStatus status;    // latest status (phase "starting" before the first one)
  double status_age_s = 0.0;     // seconds since the latest status
  bool ready() const { return process_alive && connected && status.phase == "ready"; }
  std::string not_ready_reason() const;
};

class WorkerLink {
 public:
  // Binds the ROUTER on `endpoint` (e.g. "ipc:///tmp/bg-x/router.sock"); n_ranks workers are expected, in DP groups
  // of `tp` ranks whose first rank (the group's leader) takes the group's requests.
  WorkerLink(zmq::context_t& ctx, const std::string& endpoint, int32_t n_ranks, int32_t tp = 1);
  ~WorkerLink();
  WorkerLink(const WorkerLink&) = delete;
  WorkerLink& operator=(const WorkerLink&) = delete;

  void start();
  void stop();

  // Registers the request and sends it to the least-loaded DP group (its leader): the fewest tokens in flight
  // relative to its KV capacity plus its KV / state memory in use. Throws ApiError(503) when no rank is ready.
  std::shared_ptr<RequestEvents> submit(const proto::GenerateRequest& req);
  // Tells the worker to drop the request; its final ("abort") event is still routed to the queue if it is alive.
  void cancel(const std::string& id);
  // Asks every rank to shut down cleanly.
  void shutdown_workers();

  // From the worker manager: the rank's process has exited; its in-flight requests fail with `reason` (with several
  // ranks every request fails: the set cannot step without that rank).
  void mark_exited(int32_t rank, const std::string& reason);
  // From the worker manager, before it starts a rank set again: every rank is "starting" (not connected, alive).
  void reset_ranks();

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
  // The load of a DP group (its leader `rank`) for balancing; lower is better. Caller holds mu_.
  double load_of(int32_t rank) const;

  void run();
  void send_command(int32_t rank, const std::string& frame);
  void on_worker_message(const std::string& identity, const std::string& frame);
  void forward_command(const std::string& identity, const std::string& frame);
  void fail_rank_requests(int32_t rank, const std::string& reason, int32_t code);

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
  std::vector<int64_t> in_flight_;         // per rank
  std::vector<int64_t> in_flight_tokens_;  // per rank
  int32_t tp_ = 1;
};

}  // namespace bg::frontend

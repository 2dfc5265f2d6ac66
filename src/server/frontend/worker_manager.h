// Supervision of the worker set (one `batchgen worker` process per rank): fork/exec, exit and heartbeat checks, and
// restarts. The set is the unit: it is ready when every rank is ready, and when any rank dies, hangs (no heartbeat
// within the deadline) or fails, every rank is stopped, every in-flight request fails with a clear 503, and the
// whole set is started again after an exponential backoff. Too many restarts in a row (a crash loop) end with
// /ready false and /health 503. A failure before the set was ever ready is reported to `serve`, which exits with it.
// Ranks on other nodes (serve --nnodes > 1) are started, killed and reaped through their node's agent (RemoteRanks,
// implemented by NodeLink); the set treats them like its own children.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace bg::frontend {

class WorkerLink;

struct SupervisorConfig {
  std::chrono::milliseconds heartbeat_timeout{60'000};  // no status or token event for this long: hung
  int max_restarts = 5;                                  // restarts in a row before giving up
  std::chrono::milliseconds backoff_initial{1'000};      // delay before restart k: initial * 2^(k-1), capped
  std::chrono::milliseconds backoff_max{30'000};
  std::chrono::milliseconds stable_after{60'000};        // ready this long: the restart streak starts over
  std::chrono::milliseconds tick{100};                   // how often the supervisor looks
  std::chrono::milliseconds node_join_timeout{600'000};  // a node whose agent never came: named after this
  std::string identity_suffix;                           // appended to routing ids ("-<hex>": unguessable over TCP)
};

// What the supervisor knows of a rank that runs on another node (from that node's agent).
struct RemoteRank {
  int32_t node = 0;
  bool started = false;        // this incarnation's start reached the node's agent
  int64_t pid = 0;             // on that host, as the agent reported it (0: not yet)
  bool exited = false;         // the agent reaped it (wait_status)
  int wait_status = 0;
  std::string node_gone;       // the agent that started it is gone (why): so is the rank
  std::string waiting;         // not started: why (no agent connected yet)
};

// The ranks of other nodes, run by their node agents (node_link.h). Called from the supervisor thread only.
class RemoteRanks {
 public:
  virtual ~RemoteRanks() = default;
  virtual bool is_remote(int32_t rank) const = 0;
  virtual int32_t node_of(int32_t rank) const = 0;
  // Every remote rank of `incarnation`, with routing ids indexed by rank (local entries unused); an agent that is
  // not connected gets it when it comes.
  virtual void start(int64_t incarnation, const std::vector<std::string>& identities) = 0;
  // SIGKILL to the incarnation's remote ranks (their exits are reported back).
  virtual void kill(int64_t incarnation) = 0;
  virtual RemoteRank state(int32_t rank, int64_t incarnation) const = 0;
};

// Rank r's command line (argv[0] = the executable) for a process with routing id `identity`.
using WorkerCommand = std::function<std::vector<std::string>(int32_t rank, const std::string& identity)>;

class WorkerManager {
 public:
  enum class Phase { starting, serving, restarting, gave_up, failed_at_start, stopped };

  // remote (may be null): the ranks it says are remote are not forked here.
  WorkerManager(WorkerLink& link, int32_t n_ranks, WorkerCommand command, SupervisorConfig cfg = {},
                RemoteRanks* remote = nullptr);
  ~WorkerManager();
  WorkerManager(const WorkerManager&) = delete;
  WorkerManager& operator=(const WorkerManager&) = delete;

  // Starts the supervisor thread, which spawns the set, and returns once it has. The children get
  // PR_SET_PDEATHSIG(SIGTERM), tied to the thread that forks them: the supervisor thread lives until stop().
  void start();
  // Asks every rank to shut down ("shutdown" message), waits up to `grace`, then SIGKILLs what is left; reaps all.
  void stop(std::chrono::milliseconds grace);

  Phase phase() const;
  // Why the set failed before it was ever ready (failed_at_start) or why the supervisor gave up.
  std::string failure() const;
  // Waits up to `timeout` for the phase to change from `from`; returns the current phase.
  Phase wait_change(Phase from, std::chrono::milliseconds timeout) const;

 private:
  struct Child {
    int32_t rank = 0;
    pid_t pid = -1;
    bool remote = false;         // runs on another node (pid is the agent's report)
    bool remote_started = false; // its start reached the agent (the heartbeat deadline counts from then)
    bool never_started = false;  // remote, and stopped before its node's agent got the start
    std::string waiting_note;    // remote, not started: why (shown in /ready)
    bool exited = false;
    int wait_status = 0;
    std::chrono::steady_clock::time_point spawned;
  };

  void run();
  void spawn_set();
  pid_t spawn(int32_t rank, const std::string& identity);
  void reap_nonblocking();
  std::string find_failure(int32_t& rank);
  std::string remote_failure(const Child& c, const RemoteRank& st, std::chrono::steady_clock::time_point now) const;
  void poll_remote(Child& c);
  void kill_remote();
  std::string rank_name(int32_t rank) const;
  bool wait_exit(Child& c, std::chrono::milliseconds limit);
  void on_failure(int32_t rank, const std::string& failure);
  void kill_set();
  void shutdown_set();
  void set_phase(Phase p);

  WorkerLink& link_;
  const int32_t n_ranks_;
  WorkerCommand command_;
  SupervisorConfig cfg_;
  RemoteRanks* remote_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_requested_{false};
  std::chrono::milliseconds stop_grace_{10'000};

  mutable std::mutex mu_;                 // guards phase_ and failure_
  mutable std::condition_variable cv_;
  Phase phase_ = Phase::starting;
  std::string failure_;
  bool first_spawn_done_ = false;

  // Supervisor thread only.
  std::vector<Child> children_;
  int64_t incarnation_ = 0;
  bool ever_ready_ = false;
  int streak_ = 0;                        // restarts since the set was last ready for stable_after
  std::chrono::steady_clock::time_point ready_since_;
  std::chrono::steady_clock::time_point restart_at_;
};

// "exited with status 1" / "killed by signal 9 (Killed)" from a waitpid status.
std::string describe_exit(int wait_status);

}  // namespace bg::frontend

// RankState: what /ready, /health and /metrics report about one worker rank (a snapshot taken by WorkerLink).
#pragma once

#include <cstdint>
#include <string>

#include "server/protocol.h"

namespace bg::frontend {

// What /ready, /health and /metrics report about one rank (a snapshot).
struct RankState {
  int32_t rank = 0;
  int32_t node = -1;             // the node it runs on when the set spans several (-1: one host)
  std::string identity;          // the routing id of the current incarnation ("rank-0-i3")
  int64_t pid = 0;               // its process (0 before the first spawn)
  bool connected = false;        // a status from the current incarnation has arrived
  bool process_alive = true;     // the supervisor has not seen the current process exit
  std::string exit_reason;       // why the last process is gone
  std::string supervisor_note;   // what the supervisor is doing about it ("restarting in 2.0 s ...")
  bool gave_up = false;          // the supervisor stopped restarting (crash loop)
  int64_t restarts = 0;          // restarts of the worker set since serve started
  proto::WorkerStatus status;    // latest status of the current incarnation (phase "starting" before the first)
  double status_age_s = 0.0;     // seconds since the latest status (since the spawn before the first)
  double heartbeat_timeout_s = 60.0;
  bool heartbeat_ok() const { return status_age_s <= heartbeat_timeout_s; }
  bool ready() const { return process_alive && connected && status.phase == "ready" && heartbeat_ok(); }
  // starting | loading | ready | failed | hung | exited | restarting | gave_up
  std::string state() const;
  std::string not_ready_reason() const;
  // "rank 2", or "rank 2 (node 1)" when the set spans several nodes.
  std::string name() const;
};

}  // namespace bg::frontend

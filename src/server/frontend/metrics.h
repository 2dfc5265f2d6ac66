// Frontend metrics (request counters, token counters, latency histograms) and their Prometheus text rendering,
// together with the workers' scheduler and memory gauges from their status messages and their supervision state
// (ready, process up, heartbeat age, restarts). Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/frontend/rank_state.h"

namespace bg::frontend {

// A cumulative Prometheus histogram over fixed upper bounds (seconds).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // "# HELP", "# TYPE" and the _bucket/_sum/_count lines.
  std::string render(const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative; last = +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  void count_request(const std::string& endpoint, int status);
  void count_finish(const std::string& reason);   // stop, length, tool_calls, abort, error
  void count_cancel_by_client();                  // client went away mid-request
  void add_tokens(int64_t prompt, int64_t generated);
  void observe_ttft(double seconds) { ttft_.observe(seconds); }
  void observe_itl(double seconds) { itl_.observe(seconds); }
  void observe_e2e(double seconds) { e2e_.observe(seconds); }
  void add_in_flight(int64_t delta) { in_flight_ += delta; }

  // Worker gauges come from each rank's latest status and the supervisor's view of it.
  std::string render(const std::vector<RankState>& ranks) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // (endpoint, status) -> count
  std::map<std::string, uint64_t> finished_;                  // finish reason -> count
  std::atomic<uint64_t> cancelled_by_client_{0};
  std::atomic<int64_t> prompt_tokens_{0};
  std::atomic<int64_t> generation_tokens_{0};
  std::atomic<int64_t> in_flight_{0};
  Histogram ttft_;
  Histogram itl_;
  Histogram e2e_;
};

}  // namespace bg::frontend

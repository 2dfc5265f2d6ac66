// Prometheus text exposition (format 0.0.4) of the frontend counters and the workers' status gauges.
#include "server/frontend/metrics.h"

#include <fmt/format.h>

namespace bg::frontend {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  std::lock_guard lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

std::string Histogram::render(const std::string& name, const std::string& help) const {
  std::lock_guard lock(mu_);
  std::string out = fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  cumulative += counts_.back();
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cumulative, name, sum_, name,
                     count_);
  return out;
}

Metrics::Metrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0}),
      itl_({0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
            1.0, 2.5}),
      e2e_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0}) {}

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard lock(mu_);
  ++requests_[{endpoint, status}];
}

void Metrics::count_finish(const std::string& reason) {
  std::lock_guard lock(mu_);
  ++finished_[reason];
}

void Metrics::count_cancel_by_client() { ++cancelled_by_client_; }

void Metrics::add_tokens(int64_t prompt, int64_t generated) {
  prompt_tokens_ += prompt;
  generation_tokens_ += generated;
}

namespace {

void gauge_header(std::string& out, const char* name, const char* help, const char* type = "gauge") {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

// One gauge per rank: name{rank="r"} value.
template <typename F>
void per_rank(std::string& out, const char* name, const char* help, const std::vector<RankState>& rs, F value) {
  gauge_header(out, name, help);
  for (const RankState& s : rs) out += fmt::format("{}{{rank=\"{}\"}} {}\n", name, s.rank, value(s.status));
}

// Gauges of the supervisor's view (they stay true while a worker is dead, hung or restarting).
void render_supervision(std::string& out, const std::vector<RankState>& rs) {
  gauge_header(out, "batchgen_worker_ready", "1 when the rank is loaded, serving and its heartbeat is on time");
  for (const RankState& s : rs) out += fmt::format("batchgen_worker_ready{{rank=\"{}\"}} {}\n", s.rank, s.ready() ? 1 : 0);
  gauge_header(out, "batchgen_worker_up", "1 while the rank's current process runs");
  for (const RankState& s : rs) {
    out += fmt::format("batchgen_worker_up{{rank=\"{}\"}} {}\n", s.rank, s.process_alive ? 1 : 0);
  }
  gauge_header(out, "batchgen_worker_state", "1 for the rank's current supervision state");
  for (const RankState& s : rs) {
    out += fmt::format("batchgen_worker_state{{rank=\"{}\",state=\"{}\"}} 1\n", s.rank, s.state());
  }
  gauge_header(out, "batchgen_worker_heartbeat_age_seconds", "Seconds since the rank's last status or token event");
  for (const RankState& s : rs) {
    out += fmt::format("batchgen_worker_heartbeat_age_seconds{{rank=\"{}\"}} {:.3f}\n", s.rank, s.status_age_s);
  }
  gauge_header(out, "batchgen_worker_restarts_total", "Restarts of the worker set since serve started", "counter");
  out += fmt::format("batchgen_worker_restarts_total {}\n", rs.empty() ? 0 : rs.front().restarts);
}

void render_workers(std::string& out, const std::vector<RankState>& ws) {
  using W = proto::WorkerStatus;
  render_supervision(out, ws);
  per_rank(out, "batchgen_num_requests_running", "Sequences in the worker's running batch", ws,
           [](const W& w) { return w.running; });
  per_rank(out, "batchgen_num_requests_waiting", "Requests queued at the worker (queue depth)", ws,
           [](const W& w) { return w.waiting; });
  per_rank(out, "batchgen_batch_size", "Sequences in the last step", ws, [](const W& w) { return w.last_batch_size; });
  per_rank(out, "batchgen_batch_tokens", "Tokens in the last step", ws, [](const W& w) { return w.last_batch_tokens; });
  per_rank(out, "batchgen_kv_blocks_used", "MLA KV blocks in use", ws,
           [](const W& w) { return w.kv_blocks_total - w.kv_blocks_free; });
  per_rank(out, "batchgen_kv_blocks_total", "MLA KV blocks in the pool", ws,
           [](const W& w) { return w.kv_blocks_total; });
  per_rank(out, "batchgen_state_slots_used", "Recurrent (KDA) state slots in use", ws,
           [](const W& w) { return w.state_slots_total - w.state_slots_free; });
  per_rank(out, "batchgen_state_slots_total", "Recurrent (KDA) state slots in the pool", ws,
           [](const W& w) { return w.state_slots_total; });
  per_rank(out, "batchgen_kv_blocks_cached", "MLA KV blocks held only by the prefix cache (evictable)", ws,
           [](const W& w) { return w.kv_blocks_cached; });
  per_rank(out, "batchgen_state_slots_cached", "Recurrent state slots holding prefix-cache snapshots", ws,
           [](const W& w) { return w.state_slots_cached; });
  per_rank(out, "batchgen_kv_gpu_bytes_used", "GPU bytes of MLA KV blocks in use", ws,
           [](const W& w) { return w.kv_bytes_used; });
  per_rank(out, "batchgen_state_gpu_bytes_used", "GPU bytes of recurrent state slots in use", ws,
           [](const W& w) { return w.state_bytes_used; });
  per_rank(out, "batchgen_longest_sequence_tokens", "Positions of the running sequence that holds the most", ws,
           [](const W& w) { return w.longest_seq_tokens; });
  per_rank(out, "batchgen_longest_sequence_gpu_bytes", "GPU bytes (KV blocks and state slot) of that sequence", ws,
           [](const W& w) { return w.longest_seq_gpu_bytes; });
  per_rank(out, "batchgen_host_tier_bytes_total", "Host tier (pinned host memory) size", ws,
           [](const W& w) { return w.host_bytes_total; });
  per_rank(out, "batchgen_kv_host_bytes_used", "Host-tier bytes holding MLA KV blocks", ws,
           [](const W& w) { return w.host_kv_bytes; });
  per_rank(out, "batchgen_state_host_bytes_used", "Host-tier bytes holding recurrent state", ws,
           [](const W& w) { return w.host_state_bytes; });
  per_rank(out, "batchgen_num_requests_offloaded", "Preempted sequences waiting in the host tier", ws,
           [](const W& w) { return w.seqs_offloaded; });
  per_rank(out, "batchgen_prefix_cache_queries_total", "Requests started with the prefix cache on", ws,
           [](const W& w) { return w.prefix_cache_lookups_total; });
  per_rank(out, "batchgen_prefix_cache_hits_total", "Requests that reused cached prompt tokens", ws,
           [](const W& w) { return w.prefix_cache_hits_total; });
  per_rank(out, "batchgen_prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache", ws,
           [](const W& w) { return w.prefix_cache_lookup_tokens_total; });
  per_rank(out, "batchgen_prefix_cache_hit_tokens_total", "Prompt tokens reused from the prefix cache (prefill "
           "saved)", ws, [](const W& w) { return w.prefix_cache_hit_tokens_total; });
  per_rank(out, "batchgen_prefix_cache_hit_rate", "Cached / looked-up prompt tokens since the worker started", ws,
           [](const W& w) {
             return w.prefix_cache_lookup_tokens_total > 0
                        ? static_cast<double>(w.prefix_cache_hit_tokens_total) /
                              static_cast<double>(w.prefix_cache_lookup_tokens_total)
                        : 0.0;
           });
  per_rank(out, "batchgen_offloads_total", "Sequences moved to the host tier", ws,
           [](const W& w) { return w.offloads_total; });
  per_rank(out, "batchgen_restores_total", "Sequences brought back from the host tier", ws,
           [](const W& w) { return w.restores_total; });
  per_rank(out, "batchgen_rotations_total", "Requests that yielded their GPU place to a waiting one", ws,
           [](const W& w) { return w.rotations_total; });
  per_rank(out, "batchgen_worker_preemptions_total", "Preemptions since the worker started", ws,
           [](const W& w) { return w.preemptions_total; });
  per_rank(out, "batchgen_worker_steps_total", "Engine steps since the worker started", ws,
           [](const W& w) { return w.steps_total; });
  per_rank(out, "batchgen_expert_copies_total", "Streamed experts copied into the expert pool (--resident-experts)",
           ws, [](const W& w) { return w.expert_copies_total; });
  per_rank(out, "batchgen_expert_pool_hits_total", "Routed streamed experts found already in the pool", ws,
           [](const W& w) { return w.expert_pool_hits_total; });
  per_rank(out, "batchgen_expert_bytes_copied_total", "Bytes copied into the expert pool", ws,
           [](const W& w) { return w.expert_bytes_copied_total; });
  per_rank(out, "batchgen_expert_prefetches_total", "Streamed experts copied ahead while the layer before them ran",
           ws, [](const W& w) { return w.expert_prefetches_total; });
  per_rank(out, "batchgen_expert_prefetch_hits_total", "Prefetched experts their layer used", ws,
           [](const W& w) { return w.expert_prefetch_hits_total; });
}

}  // namespace

std::string Metrics::render(const std::vector<RankState>& workers) const {
  std::string out;
  {
    std::lock_guard lock(mu_);
    gauge_header(out, "batchgen_requests_total", "HTTP requests by endpoint and status code", "counter");
    for (const auto& [key, n] : requests_) {
      out += fmt::format("batchgen_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, n);
    }
    gauge_header(out, "batchgen_requests_finished_total", "Generations finished, by finish reason", "counter");
    for (const auto& [reason, n] : finished_) {
      out += fmt::format("batchgen_requests_finished_total{{reason=\"{}\"}} {}\n", reason, n);
    }
  }
  gauge_header(out, "batchgen_requests_cancelled_total", "Generations cancelled because the client went away",
               "counter");
  out += fmt::format("batchgen_requests_cancelled_total {}\n", cancelled_by_client_.load());
  gauge_header(out, "batchgen_prompt_tokens_total", "Prompt tokens of finished generations", "counter");
  out += fmt::format("batchgen_prompt_tokens_total {}\n", prompt_tokens_.load());
  gauge_header(out, "batchgen_generation_tokens_total", "Generated tokens of finished generations", "counter");
  out += fmt::format("batchgen_generation_tokens_total {}\n", generation_tokens_.load());
  gauge_header(out, "batchgen_requests_in_flight", "Generations the frontend is waiting on");
  out += fmt::format("batchgen_requests_in_flight {}\n", in_flight_.load());
  out += ttft_.render("batchgen_time_to_first_token_seconds", "Time from request to first generated token");
  out += itl_.render("batchgen_inter_token_latency_seconds", "Time between consecutive generated tokens");
  out += e2e_.render("batchgen_request_latency_seconds", "Time from request to the last token");
  render_workers(out, workers);
  return out;
}

}  // namespace bg::frontend

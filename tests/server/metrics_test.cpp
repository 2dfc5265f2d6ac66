// Prometheus text: counters by label, histogram buckets (cumulative), worker gauges per rank.
#include <gtest/gtest.h>

#include <sstream>

#include "server/frontend/metrics.h"

namespace bg::frontend {
namespace {

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(Metrics, HistogramIsCumulative) {
  Histogram h({0.1, 1.0});
  h.observe(0.0625);
  h.observe(0.5);
  h.observe(0.5);
  h.observe(7.0);
  const std::string t = h.render("x_seconds", "help");
  EXPECT_TRUE(has_line(t, "# TYPE x_seconds histogram")) << t;
  EXPECT_TRUE(has_line(t, "x_seconds_bucket{le=\"0.1\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "x_seconds_bucket{le=\"1\"} 3")) << t;
  EXPECT_TRUE(has_line(t, "x_seconds_bucket{le=\"+Inf\"} 4")) << t;
  EXPECT_TRUE(has_line(t, "x_seconds_sum 8.0625")) << t;
  EXPECT_TRUE(has_line(t, "x_seconds_count 4")) << t;
}

TEST(Metrics, RenderCountersAndWorkerGauges) {
  Metrics m;
  m.count_request("/v1/completions", 200);
  m.count_request("/v1/completions", 200);
  m.count_request("/v1/chat/completions", 400);
  m.count_finish("stop");
  m.count_cancel_by_client();
  m.add_tokens(10, 4);
  m.add_in_flight(2);
  m.observe_ttft(0.03);
  m.observe_itl(0.01);
  proto::WorkerStatus w;
  w.rank = 0;
  w.phase = "ready";
  w.running = 3;
  w.waiting = 2;
  w.last_batch_size = 3;
  w.kv_blocks_total = 100;
  w.kv_blocks_free = 90;
  w.state_slots_total = 8;
  w.state_slots_free = 5;
  w.prefix_cache_lookup_tokens_total = 200;
  w.prefix_cache_hit_tokens_total = 50;
  w.host_kv_bytes = 4096;
  w.state_bytes_used = 1000;
  w.expert_copies_total = 7;
  w.expert_bytes_copied_total = 7168;
  w.expert_prefetches_total = 5;
  w.expert_prefetch_hits_total = 4;
  w.longest_seq_tokens = 262144;
  w.longest_seq_gpu_bytes = 322125824;
  RankState rank0;
  rank0.connected = true;
  rank0.status = w;
  rank0.restarts = 2;
  rank0.status_age_s = 0.25;
  RankState rank1;  // a rank whose process died: not ready, not up, whatever its last status said
  rank1.rank = 1;
  rank1.connected = true;
  rank1.status = w;
  rank1.status.rank = 1;
  rank1.process_alive = false;
  rank1.restarts = 2;
  const std::string t = m.render({rank0, rank1});
  EXPECT_TRUE(has_line(t, "batchgen_prefix_cache_hit_tokens_total{rank=\"0\"} 50")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_prefix_cache_hit_rate{rank=\"0\"} 0.25")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_kv_host_bytes_used{rank=\"0\"} 4096")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_state_gpu_bytes_used{rank=\"0\"} 1000")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_expert_copies_total{rank=\"0\"} 7")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_longest_sequence_tokens{rank=\"0\"} 262144")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_longest_sequence_gpu_bytes{rank=\"0\"} 322125824")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_expert_bytes_copied_total{rank=\"0\"} 7168")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_expert_prefetches_total{rank=\"0\"} 5")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_expert_prefetch_hits_total{rank=\"0\"} 4")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_requests_finished_total{reason=\"stop\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_requests_cancelled_total 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_prompt_tokens_total 10")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_generation_tokens_total 4")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_requests_in_flight 2")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_time_to_first_token_seconds_count 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_inter_token_latency_seconds_count 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_ready{rank=\"0\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_ready{rank=\"1\"} 0")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_up{rank=\"1\"} 0")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_state{rank=\"0\",state=\"ready\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_state{rank=\"1\",state=\"exited\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_heartbeat_age_seconds{rank=\"0\"} 0.250")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_worker_restarts_total 2")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_num_requests_running{rank=\"0\"} 3")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_num_requests_waiting{rank=\"0\"} 2")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_batch_size{rank=\"0\"} 3")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_kv_blocks_used{rank=\"0\"} 10")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_kv_blocks_total{rank=\"0\"} 100")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_state_slots_used{rank=\"0\"} 3")) << t;
  EXPECT_TRUE(has_line(t, "batchgen_state_slots_total{rank=\"0\"} 8")) << t;
  // Every sample line belongs to a declared metric family.
  std::istringstream in(t);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::string name = line.substr(0, line.find_first_of("{ "));
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (family.size() > s.size() && family.compare(family.size() - s.size(), s.size(), s) == 0 &&
          t.find("# TYPE " + family.substr(0, family.size() - s.size()) + " histogram") != std::string::npos) {
        family = family.substr(0, family.size() - s.size());
      }
    }
    EXPECT_NE(t.find("# TYPE " + family + " "), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace bg::frontend

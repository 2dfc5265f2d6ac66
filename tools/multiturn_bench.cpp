// The multi-turn benchmark: workloads driven step by step through one Engine, timed on the host clock.
#include "tools/multiturn_bench.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <random>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "sched/planner.h"

namespace bg::tools {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

struct EngineSetup {
  bool prefix_cache = true;
  double host_memory_gb = 0.0;
  int64_t swap_quantum_steps = 0;
};

std::unique_ptr<engine::Engine> make_engine(const MultiturnOptions& o, const EngineSetup& e, sched::Plan* plan_out) {
  const sched::ModelGeometry geo = sched::read_model_geometry(o.model_dir);
  sched::PlannerInput in;
  in.device = o.device;
  in.kv_block_size = o.kv_block_size;
  in.max_num_seqs = o.max_num_seqs;
  in.max_model_len = o.max_model_len;
  in.kv_cache_memory_bytes = o.kv_cache_memory_bytes;
  in.gpu_memory_utilization = o.gpu_memory_utilization;
  in.host_memory_bytes = static_cast<int64_t>(e.host_memory_gb * static_cast<double>(int64_t{1} << 30));
  in.prefix_cache = e.prefix_cache;
  in.snapshot_interval = o.snapshot_interval;
  in.deterministic = o.deterministic;
  const sched::Plan plan = sched::make_plan(geo, in);
  log::info("bench-multiturn: {}", plan.describe());
  sched::SchedulerConfig sc;
  sc.max_num_seqs = plan.max_num_seqs;
  sc.max_model_len = plan.max_model_len;
  sc.chunked_prefill_size = o.chunked_prefill_size;
  sc.max_queue = 1 << 20;
  sc.swap_quantum_steps = e.swap_quantum_steps;
  sc.deterministic = o.deterministic;
  if (plan_out != nullptr) *plan_out = plan;
  return std::make_unique<engine::Engine>(load_model(o.model_dir, plan.load_options()), plan.state_plan(), sc);
}

proto::GenerateRequest greedy(const std::string& id, std::vector<int32_t> prompt, int64_t max_tokens) {
  proto::GenerateRequest g;
  g.id = id;
  g.prompt = std::move(prompt);
  g.params.temperature = 0.0f;
  g.params.max_tokens = max_tokens;
  g.params.ignore_eos = true;
  return g;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5)];
}

struct TurnRecord {
  Clock::time_point submitted;
  double ttft_ms = -1.0;
  std::vector<int32_t> tokens;
};

// Part 1 with one engine: every conversation starts at once; each turn = history + reply + new user tokens.
nlohmann::json run_conversations(const MultiturnOptions& o, const EngineSetup& setup,
                                 std::map<std::string, std::vector<int32_t>>& outputs) {
  auto engine = make_engine(o, setup, nullptr);
  const int64_t V = engine->model().info().vocab_size;
  std::mt19937_64 rng(o.seed);
  auto random_ids = [&](int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int32_t& t : v) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(V));
    return v;
  };
  const std::vector<int32_t> system = random_ids(o.system_tokens);
  std::vector<std::vector<std::vector<int32_t>>> user(static_cast<size_t>(o.conversations));
  for (auto& turns : user) {
    for (int64_t t = 0; t < o.turns; ++t) turns.push_back(random_ids(o.user_tokens));
  }
  std::vector<std::vector<int32_t>> history(static_cast<size_t>(o.conversations), system);
  std::map<std::string, TurnRecord> records;
  std::map<std::string, std::pair<int64_t, int64_t>> owner;  // id -> (conversation, turn)
  auto submit = [&](int64_t c, int64_t t) {
    std::vector<int32_t>& h = history[static_cast<size_t>(c)];
    const auto& u = user[static_cast<size_t>(c)][static_cast<size_t>(t)];
    h.insert(h.end(), u.begin(), u.end());
    const std::string id = fmt::format("c{}.t{}", c, t);
    owner[id] = {c, t};
    records[id].submitted = Clock::now();
    engine->submit(greedy(id, h, o.reply_tokens));
  };
  const auto start = Clock::now();
  for (int64_t c = 0; c < o.conversations; ++c) submit(c, 0);
  int64_t cached = 0;
  while (engine->has_work()) {
    engine->step();
    for (const proto::TokenEvent& ev : engine->take_events()) {
      BG_CHECK(ev.finish_reason != "error", "bench-multiturn: request {} failed: {}", ev.id, ev.error);
      TurnRecord& r = records[ev.id];
      if (r.ttft_ms < 0 && !ev.tokens.empty()) r.ttft_ms = ms_since(r.submitted);
      r.tokens.insert(r.tokens.end(), ev.tokens.begin(), ev.tokens.end());
      if (ev.finish_reason.empty()) continue;
      cached += ev.cached_tokens;
      const auto [c, t] = owner[ev.id];
      outputs[ev.id] = r.tokens;
      auto& h = history[static_cast<size_t>(c)];
      h.insert(h.end(), r.tokens.begin(), r.tokens.end());
      if (t + 1 < o.turns) submit(c, t + 1);
    }
  }
  const double wall_ms = ms_since(start);
  std::vector<double> first_turn, later_turns;
  for (const auto& [id, r] : records) (owner[id].second == 0 ? first_turn : later_turns).push_back(r.ttft_ms);
  const engine::EngineStats& s = engine->stats();
  const kv::StateUsage u = engine->state().usage();
  nlohmann::json j;
  j["prefix_cache"] = setup.prefix_cache;
  j["requests"] = records.size();
  j["wall_s"] = wall_ms / 1000.0;
  j["prompt_tokens"] = s.prompt_tokens_total;
  j["cached_tokens"] = cached;
  // Every reply token but the last is fed back as a decode token; the rest of what ran is prefill.
  const int64_t decode_tokens = s.generation_tokens_total - static_cast<int64_t>(records.size());
  j["prefill_tokens_computed"] = s.computed_tokens_total - decode_tokens;
  j["ttft_ms_turn1_mean"] = first_turn.empty() ? 0.0 : percentile(first_turn, 0.5);
  j["ttft_ms_later_p50"] = percentile(later_turns, 0.5);
  j["ttft_ms_later_p90"] = percentile(later_turns, 0.9);
  j["ttft_ms_all_p50"] = percentile([&] {
    std::vector<double> all = first_turn;
    all.insert(all.end(), later_turns.begin(), later_turns.end());
    return all;
  }(), 0.5);
  j["cache_hit_rate"] = u.cache_lookup_tokens > 0 ? static_cast<double>(u.cache_hit_tokens) /
                                                        static_cast<double>(u.cache_lookup_tokens) : 0.0;
  j["offloads"] = u.offloads;
  j["cache_evictions"] = u.cache_evictions;
  return j;
}

// Part 2 with one engine: all requests submitted at once; in flight = running + offloaded (started, not finished).
nlohmann::json run_concurrency(const MultiturnOptions& o, const EngineSetup& setup, int64_t n_requests) {
  sched::Plan plan;
  auto engine = make_engine(o, setup, &plan);
  const int64_t V = engine->model().info().vocab_size;
  std::mt19937_64 rng(o.seed + 1);
  std::map<std::string, Clock::time_point> submitted;
  std::vector<double> ttft;
  const auto start = Clock::now();
  for (int64_t i = 0; i < n_requests; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(o.concurrency_prompt));
    for (int32_t& t : p) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(V));
    const std::string id = fmt::format("r{}", i);
    submitted[id] = Clock::now();
    engine->submit(greedy(id, p, o.concurrency_tokens));
  }
  int64_t most_in_flight = 0, generated = 0;
  while (engine->has_work()) {
    engine->step();
    const int64_t in_flight = engine->scheduler().n_running() + engine->state().usage().seqs_offloaded;
    most_in_flight = std::max(most_in_flight, in_flight);
    for (const proto::TokenEvent& ev : engine->take_events()) {
      BG_CHECK(ev.finish_reason != "error", "bench-multiturn: request {} failed: {}", ev.id, ev.error);
      if (!ev.tokens.empty() && submitted.count(ev.id) != 0) {
        ttft.push_back(ms_since(submitted[ev.id]));
        submitted.erase(ev.id);
      }
      generated += static_cast<int64_t>(ev.tokens.size());
    }
  }
  const double wall_s = ms_since(start) / 1000.0;
  nlohmann::json j;
  j["host_memory_gb"] = setup.host_memory_gb;
  j["swap_quantum_steps"] = setup.swap_quantum_steps;
  j["gpu_state_slots"] = plan.state_slots;
  j["gpu_kv_blocks"] = plan.kv_blocks;
  j["max_num_seqs"] = plan.max_num_seqs;
  j["requests"] = n_requests;
  j["most_in_flight"] = most_in_flight;
  j["generated_tokens"] = generated;
  j["decode_tokens_per_s"] = static_cast<double>(generated) / wall_s;
  j["wall_s"] = wall_s;
  j["ttft_ms_p50"] = percentile(ttft, 0.5);
  j["ttft_ms_p90"] = percentile(ttft, 0.9);
  j["rotations"] = engine->scheduler().rotations_total();
  j["offloads"] = engine->state().usage().offloads;
  return j;
}

void validate(const MultiturnOptions& o) {
  BG_CHECK(o.conversations >= 1 && o.turns >= 1, "--conversations {} and --turns {} must be >= 1", o.conversations,
           o.turns);
  BG_CHECK(o.system_tokens >= 0 && o.user_tokens >= 1 && o.reply_tokens >= 1, "--system-tokens {} must be >= 0, "
           "--user-tokens {} and --reply-tokens {} >= 1", o.system_tokens, o.user_tokens, o.reply_tokens);
  BG_CHECK(o.concurrency_requests >= 0 && o.concurrency_prompt >= 1 && o.concurrency_tokens >= 1,
           "--concurrency-requests {} must be >= 0, --concurrency-prompt {} and --concurrency-tokens {} >= 1",
           o.concurrency_requests, o.concurrency_prompt, o.concurrency_tokens);
  BG_CHECK(o.concurrency_requests == 0 || o.host_memory_gb > 0.0, "--concurrency-requests compares runs without and "
           "with the host tier: give --host-memory-gb");
}

}  // namespace

nlohmann::json run_multiturn_bench(const MultiturnOptions& o) {
  validate(o);
  nlohmann::json report;
  std::map<std::string, std::vector<int32_t>> off_out, on_out;
  const nlohmann::json off = run_conversations(o, {false, o.host_memory_gb, 0}, off_out);
  const nlohmann::json on = run_conversations(o, {true, o.host_memory_gb, 0}, on_out);
  report["multiturn"] = {{"conversations", o.conversations}, {"turns", o.turns}, {"system_tokens", o.system_tokens},
                         {"user_tokens", o.user_tokens}, {"reply_tokens", o.reply_tokens},
                         {"deterministic", o.deterministic}, {"cache_off", off}, {"cache_on", on},
                         {"outputs_identical", off_out == on_out}};
  log::info("bench-multiturn: {} conversations x {} turns, system prompt {} tokens", o.conversations, o.turns,
            o.system_tokens);
  for (const nlohmann::json* r : {&off, &on}) {
    log::info("  prefix cache {:3}: TTFT p50 {:8.1f} ms (turn 1 p50 {:8.1f}, later turns p50 {:8.1f} p90 {:8.1f}); "
              "prefill computed {} of {} prompt tokens (cached {}); wall {:.1f} s",
              (*r)["prefix_cache"].get<bool>() ? "on" : "off", (*r)["ttft_ms_all_p50"].get<double>(),
              (*r)["ttft_ms_turn1_mean"].get<double>(), (*r)["ttft_ms_later_p50"].get<double>(),
              (*r)["ttft_ms_later_p90"].get<double>(), (*r)["prefill_tokens_computed"].get<int64_t>(),
              (*r)["prompt_tokens"].get<int64_t>(), (*r)["cached_tokens"].get<int64_t>(), (*r)["wall_s"].get<double>());
  }
  log::info("  outputs identical with the cache on and off: {}", off_out == on_out ? "yes" : "NO");
  if (o.concurrency_requests > 0) {
    // The prefix cache off: the same GPU pools serve running sequences only, so the host tier alone differs.
    const nlohmann::json gpu = run_concurrency(o, {false, 0.0, 0}, o.concurrency_requests);
    const nlohmann::json host = run_concurrency(o, {false, o.host_memory_gb, o.swap_quantum_steps},
                                                o.concurrency_requests);
    report["concurrency"] = {{"gpu_only", gpu}, {"host_tier", host}};
    for (const nlohmann::json* r : {&gpu, &host}) {
      log::info("  host tier {:5.2f} GiB: {} requests of {} + {} tokens: at most {} in flight ({} GPU slots), decode "
                "{:.1f} tokens/s, TTFT p50 {:.1f} ms p90 {:.1f} ms, {} rotations", (*r)["host_memory_gb"].get<double>(),
                o.concurrency_requests, o.concurrency_prompt, o.concurrency_tokens,
                (*r)["most_in_flight"].get<int64_t>(),
                (*r)["gpu_state_slots"].get<int64_t>(), (*r)["decode_tokens_per_s"].get<double>(),
                (*r)["ttft_ms_p50"].get<double>(), (*r)["ttft_ms_p90"].get<double>(), (*r)["rotations"].get<int64_t>());
    }
  }
  return report;
}

}  // namespace bg::tools

// Decode steps and prefill of a model, timed through the real Model::forward_batch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>

#include <sys/resource.h>

#include <fmt/ranges.h>

#include "bench/model_bench.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "model/fabricate_context.h"
#include "ops/sampling/sampling.h"

namespace bg::bench {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The engine's greedy id (ops::argmax: lowest id among equal logits, NaN refused) and its lead over the second
// largest logit.
std::pair<int32_t, float> greedy_pick(const std::vector<float>& logits) {
  const int32_t best = ops::argmax(logits.data(), static_cast<int64_t>(logits.size()));
  float second = -INFINITY;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (i != static_cast<size_t>(best)) second = std::max(second, logits[i]);
  }
  return {best, logits[static_cast<size_t>(best)] - second};
}

// BG_BENCH_OP_TRACE=1: every op of the profiled replay in order (which call of a name costs what, e.g. one linear).
void log_op_trace(const std::vector<OpRecord>& records, int64_t batch, int64_t context) {
  for (size_t i = 0; i < records.size(); ++i) {
    const OpRecord& o = records[i];
    log::info("op trace B={} ctx={} #{} {}{} {:.4f} ms", batch, context, i, std::string(2 * size_t(o.depth), ' '),
              o.name, o.end_ms - o.begin_ms);
  }
}

// ", paths: a 12, b 3" for the log line (empty when none was recorded).
std::string paths_text(const std::map<std::string, uint64_t>& paths) {
  std::string s;
  for (const auto& [path, n] : paths) s += fmt::format("{}{} {}", s.empty() ? ", paths: " : ", ", path, n);
  return s;
}

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;  // kilobytes on Linux
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) id = static_cast<int32_t>(pick(rng));
  return ids;
}

// Fabricated contexts hold random values, so a NaN here is a real finding, but one that must not throw away the rest
// of a long GPU run: it is logged.
void warn_if_not_finite(const std::vector<float>& logits, const std::string& what) {
  const auto bad = std::count_if(logits.begin(), logits.end(), [](float v) { return !std::isfinite(v); });
  if (bad > 0) log::warn("bench {}: {} of {} logits are not finite", what, bad, logits.size());
}

// Detaches the profiler however the scope ends (a throwing step must not leave a dangling pointer in the backend).
class ProfilerAttachment {
 public:
  ProfilerAttachment(Model& model, OpProfiler* profiler) : model_(model) { model_.backend().set_profiler(profiler); }
  ~ProfilerAttachment() { model_.backend().set_profiler(nullptr); }
  ProfilerAttachment(const ProfilerAttachment&) = delete;
  ProfilerAttachment& operator=(const ProfilerAttachment&) = delete;

 private:
  Model& model_;
};

// Distinct experts each MoE layer routes the step's rows to (one eager step; the hook sees every MoE layer in order).
std::vector<double> count_touched_experts(Model& model, std::span<const BatchEntry> batch, float* logits) {
  std::vector<double> touched;
  model.set_route_hook([&touched](int64_t, int64_t, int64_t, std::vector<int32_t>& ids, std::vector<float>&) {
    touched.push_back(static_cast<double>(std::set<int32_t>(ids.begin(), ids.end()).size()));
    return false;
  });
  try {
    model.forward_batch(batch, logits);
  } catch (...) {
    model.set_route_hook({});
    throw;
  }
  model.set_route_hook({});
  return touched;
}

StepResult bench_one_step(Model& model, kv::StateManager& state, const StepBenchSpec& spec, int64_t batch_size,
                          int64_t context, DeviceBench& device, const StepCostModel& cost, const Ceilings& ceilings) {
  const int64_t vocab = model.info().vocab_size;
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (int64_t i = 0; i < batch_size; ++i) {
    seqs.push_back(state.new_sequence());
    fabricate_sequence_context(state, *seqs.back(), context, static_cast<uint64_t>(i + 1));
    // Room for every decode token the bench runs on these sequences (warm-up, counting, replays, profiled replay).
    state.reserve(*seqs.back(), context + 8 + spec.replays);
  }
  const std::vector<int32_t> tokens = random_ids(batch_size, vocab, 7);
  std::vector<BatchEntry> batch;
  for (int64_t i = 0; i < batch_size; ++i) {
    batch.push_back({seqs[static_cast<size_t>(i)].get(), std::span<const int32_t>(tokens).subspan(i, 1)});
  }
  std::vector<float> logits(static_cast<size_t>(batch_size * vocab));
  for (int i = 0; i < 2; ++i) model.forward_batch(batch, logits.data());  // the first captures the graph
  warn_if_not_finite(logits, fmt::format("step B={} ctx={}", batch_size, context));
  // The timed steps run as the engine does: the step and its sampling on the backend (K3's temperature 1, top_p 0.95).
  std::vector<ops::RowSampling> rows(static_cast<size_t>(batch_size));
  for (int64_t i = 0; i < batch_size; ++i) {
    rows[static_cast<size_t>(i)] = {{1.0f, 0, 0.95f}, static_cast<double>(i + 1) / static_cast<double>(batch_size + 2),
                                    static_cast<int32_t>(i), -1};
  }
  std::vector<ops::RowSample> samples(rows.size());

  StepResult r;
  r.model = spec.model_name;
  r.batch = batch_size;
  r.context = context;
  r.graph = batch_size <= spec.max_graph_batch;
  const std::vector<double> touched = count_touched_experts(model, batch, logits.data());
  double touched_sum = 0;
  for (double t : touched) touched_sum += t;
  r.touched_experts = touched.empty() ? 0.0 : touched_sum / static_cast<double>(touched.size());

  std::vector<double> device_ms, wall_ms;
  const Model::ExpertStreamCounters streamed_before = model.expert_stream_counters();
  {
    std::unique_ptr<StepProfiler> profiler = device.profiler(false);
    ProfilerAttachment attach(model, profiler.get());
    for (int i = 0; i < spec.replays; ++i) {
      const auto t0 = Clock::now();
      model.forward_batch_sample(batch, rows, samples);
      wall_ms.push_back(ms_since(t0));
      device_ms.push_back(step_span_ms(profiler->take()));
    }
  }
  const Model::ExpertStreamCounters streamed = model.expert_stream_counters();
  const auto per_replay = [&](int64_t after, int64_t before) {
    return static_cast<double>(after - before) / static_cast<double>(spec.replays);
  };
  r.streamed_bytes = per_replay(streamed.bytes_copied, streamed_before.bytes_copied);
  r.prefetched_experts = per_replay(streamed.prefetches, streamed_before.prefetches);
  r.prefetch_hits = per_replay(streamed.prefetch_hits, streamed_before.prefetch_hits);
  if (ceilings.h2d_gbps && *ceilings.h2d_gbps > 0) r.copy_floor_ms = r.streamed_bytes / (*ceilings.h2d_gbps * 1e6);
  {
    std::unique_ptr<StepProfiler> profiler = device.profiler(true);
    ProfilerAttachment attach(model, profiler.get());
    model.forward_batch_sample(batch, rows, samples);
    const std::vector<OpRecord> records = profiler->take();
    if (env_switch("BG_BENCH_OP_TRACE", false)) log_op_trace(records, batch_size, context);
    r.ops = aggregate_ops(records);
    for (const OpTime& o : r.ops) r.n_ops += o.calls;
    r.ops_in_graph = std::any_of(records.begin(), records.end(), [](const OpRecord& o) { return o.in_graph; });
  }
  const SmallOps small = small_ops(r.ops, median(device_ms));
  r.small_ops_ms = small.raw_ms;
  r.op_overhead_us = small.overhead_us;
  r.small_ops_us_per_layer = 1000.0 * small.net_ms / static_cast<double>(std::max<int64_t>(1, model.info().n_layers));
  r.ms = median(device_ms);
  r.wall_ms = median(wall_ms);
  r.replays = spec.replays;
  const StepCost c = cost.decode_step(batch_size, context, touched, ceilings);
  r.roofline_ms = c.roofline_ms;
  r.roofline_bytes = c.bytes;
  r.roofline_flops = c.flops;
  r.ratio = c.roofline_ms > 0 ? r.ms / c.roofline_ms : 0.0;
  return r;
}

}  // namespace

std::vector<int32_t> bench_prompt(int64_t n, int64_t vocab) { return random_ids(n, vocab, static_cast<uint64_t>(n)); }

std::vector<StepResult> bench_steps(Model& model, kv::StateManager& state, const StepBenchSpec& spec, DeviceBench& device,
                                    const StepCostModel& cost, const Ceilings& ceilings) {
  BG_CHECK(spec.replays >= 1, "bench: --replays must be >= 1");
  std::vector<StepResult> out;
  for (int64_t context : spec.contexts) {
    for (int64_t batch : spec.batches) {
      const auto t0 = Clock::now();
      out.push_back(bench_one_step(model, state, spec, batch, context, device, cost, ceilings));
      log::info("bench step {} B={} ctx={}: {:.3f} ms (roofline {:.3f}, {:.2f}x) [{:.1f} s]", spec.model_name, batch,
                context, out.back().ms, out.back().roofline_ms, out.back().ratio, ms_since(t0) / 1e3);
      if (out.back().streamed_bytes > 0) {
        log::info("bench step {} B={}: streamed experts copied {:.1f} MB a step ({:.3f} ms at the pinned H2D rate)",
                  spec.model_name, batch, out.back().streamed_bytes / 1e6, out.back().copy_floor_ms);
      }
    }
  }
  return out;
}

std::vector<PrefillResult> bench_prefill(Model& model, kv::StateManager& state, const PrefillBenchSpec& spec,
                                         const StepCostModel& cost, const Ceilings& ceilings) {
  BG_CHECK(spec.chunk_tokens >= 1, "bench: prefill chunk {} must be >= 1", spec.chunk_tokens);
  BG_CHECK(spec.decode_tokens >= 0, "bench: --decode-tokens {} must be >= 0", spec.decode_tokens);
  const int64_t vocab = model.info().vocab_size;
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::vector<PrefillResult> out;
  bool warm = false;
  for (int64_t n_prompt : spec.prompt_tokens) {
    const std::vector<int32_t> prompt = bench_prompt(n_prompt, vocab);
    std::vector<double> chunk_ms;
    auto run = [&](Sequence& seq, int64_t n) {
      StepCost total;
      chunk_ms.clear();
      for (int64_t start = 0; start < n; start += spec.chunk_tokens) {
        const int64_t len = std::min(spec.chunk_tokens, n - start);
        const BatchEntry entry{&seq, std::span<const int32_t>(prompt).subspan(start, len)};
        const auto c0 = Clock::now();
        model.forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
        chunk_ms.push_back(ms_since(c0));
        const StepCost c = cost.prefill_chunk(start, len, ceilings);
        total.bytes += c.bytes;
        total.flops += c.flops;
        total.roofline_ms += c.roofline_ms;
      }
      return total;
    };
    if (!warm) {  // library initialisation and first-use allocations stay out of the first figure
      const int64_t n = std::min(n_prompt, spec.chunk_tokens);
      run(*state.new_sequence(n), n);
      warm = true;
    }
    std::unique_ptr<Sequence> seq = state.new_sequence(n_prompt + spec.decode_tokens);
    model.backend().reset_memory_peak();
    const std::map<std::string, uint64_t> paths0 = spec.path_counts ? spec.path_counts() : decltype(paths0){};
    const auto t0 = Clock::now();
    const StepCost total = run(*seq, n_prompt);
    PrefillResult r;
    if (spec.path_counts) {
      for (const auto& [path, n] : spec.path_counts()) {
        const auto before = paths0.find(path);
        const uint64_t d = n - (before == paths0.end() ? 0 : before->second);
        if (d > 0) r.paths[path] = d;
      }
    }
    r.model = spec.model_name;
    r.prompt_tokens = n_prompt;
    r.chunk_tokens = spec.chunk_tokens;
    r.seconds = ms_since(t0) / 1e3;
    r.chunk_ms = chunk_ms;
    const Backend::MemoryUse mem = model.backend().memory_use();
    r.peak_device_bytes = static_cast<double>(mem.peak_device_used);
    r.peak_pool_bytes = static_cast<double>(mem.peak_held);
    r.peak_in_use_bytes = static_cast<double>(mem.peak_in_use);
    r.device_total_bytes = static_cast<double>(mem.device_total);
    warn_if_not_finite(logits, fmt::format("prefill of {} tokens", n_prompt));
    r.tokens_per_s = static_cast<double>(n_prompt) / r.seconds;
    r.flops = total.flops;
    r.roofline_tokens_per_s = total.roofline_ms > 0 ? static_cast<double>(n_prompt) / (total.roofline_ms / 1e3) : 0;
    r.ratio = r.tokens_per_s > 0 ? r.roofline_tokens_per_s / r.tokens_per_s : 0.0;
    const auto t1 = Clock::now();
    for (int64_t i = 0; i < spec.decode_tokens; ++i) {
      const auto [id, margin] = greedy_pick(logits);
      r.decoded_ids.push_back(id);
      r.decode_margins.push_back(margin);
      if (i + 1 == spec.decode_tokens) break;
      const BatchEntry entry{seq.get(), std::span<const int32_t>(&r.decoded_ids.back(), 1)};
      model.forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
    }
    if (spec.decode_tokens > 1) r.decode_ms_per_token = ms_since(t1) / static_cast<double>(spec.decode_tokens - 1);
    r.peak_rss_bytes = peak_rss_bytes();
    log::info("bench prefill {} {} tokens (chunk {}): {:.2f} s, {:.0f} tokens/s (roofline {:.0f}), device memory at "
              "its peak {:.2f} GB{}", spec.model_name, n_prompt, spec.chunk_tokens, r.seconds, r.tokens_per_s,
              r.roofline_tokens_per_s, r.peak_device_bytes / 1e9, paths_text(r.paths));
    if (!r.decoded_ids.empty()) {
      log::info("bench prefill {} {} tokens: greedy continuation [{}], margins [{:.3f}], {:.2f} ms per token",
                spec.model_name, n_prompt, fmt::join(r.decoded_ids, ", "), fmt::join(r.decode_margins, ", "),
                r.decode_ms_per_token);
    }
    out.push_back(r);
  }
  return out;
}

}  // namespace bg::bench

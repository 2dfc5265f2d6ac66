// BenchReport -> JSON (the bench/*.json files) and the stdout table.
#include "bench/bench_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace bg::bench {
namespace {

using nlohmann::json;

template <typename T>
json opt(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

json device_json(const DeviceInfo& d) {
  return {{"device", d.device}, {"name", d.name}, {"driver", opt(d.driver)}, {"n_sms", d.n_sms},
          {"l2_bytes", d.l2_bytes}, {"memory_bytes", d.memory_bytes}};
}

json clocks_json(const DeviceInfo& d) {
  return {{"sm_mhz", opt(d.sm_clock_mhz)}, {"mem_mhz", opt(d.mem_clock_mhz)},
          {"sm_max_mhz", opt(d.sm_clock_max_mhz)}, {"mem_max_mhz", opt(d.mem_clock_max_mhz)}};
}

json ceilings_json(const Ceilings& c) {
  json grouped = json::array();
  for (const auto& g : c.grouped_gemm_bf16) {
    grouped.push_back({{"rows_per_expert", g.rows_per_expert}, {"ms", g.ms}, {"tflops", g.tflops},
                       {"gbps", g.gbps}, {"api", g.api}});
  }
  return {{"read_gbps", opt(c.read_gbps)},
          {"copy_gbps", opt(c.copy_gbps)},
          {"gemm_bf16_tflops", opt(c.gemm_bf16_tflops)},
          {"gemm_fp8_tflops", opt(c.gemm_fp8_tflops)},
          {"gemm_f32_tflops", opt(c.gemm_f32_tflops)},
          {"grouped_gemm_bf16", grouped},
          {"h2d_gbps", opt(c.h2d_gbps)},
          {"d2h_gbps", opt(c.d2h_gbps)},
          {"graph_node_us", opt(c.graph_node_us)},
          {"memory_reference_gbps", c.memory_gbps()},
          {"compute_reference_tflops", c.compute_tflops()}};
}

json kernel_json(const KernelResult& k) {
  json launches = json::array();
  for (const auto& l : k.launches) {
    launches.push_back({{"kernel", l.kernel}, {"grid", l.grid}, {"block", l.block}, {"dynamic_smem", l.dynamic_smem},
                        {"registers", opt(l.registers)}, {"static_smem", opt(l.static_smem)},
                        {"max_threads", opt(l.max_threads)}, {"blocks_per_sm", opt(l.blocks_per_sm)}});
  }
  return {{"name", k.name}, {"shape", k.shape}, {"ms", k.ms}, {"bytes", k.bytes}, {"flops", k.flops},
          {"gbps", k.gbps}, {"tflops", k.tflops}, {"fraction", k.fraction}, {"bound", k.bound},
          {"compute_ref", k.compute_ref}, {"copies", k.copies}, {"sets", k.sets}, {"registers", opt(k.registers)},
          {"smem", opt(k.smem)}, {"occupancy", opt(k.occupancy)}, {"error", opt(k.error)}, {"launches", launches}};
}

json step_json(const StepResult& s) {
  json ops = json::array();
  for (const auto& o : s.ops) ops.push_back({{"name", o.name}, {"calls", o.calls}, {"ms", o.ms}, {"share", o.share}});
  return {{"model", s.model}, {"batch", s.batch}, {"context", s.context}, {"graph", s.graph}, {"ms", s.ms},
          {"wall_ms", s.wall_ms}, {"roofline_ms", s.roofline_ms}, {"roofline_bytes", s.roofline_bytes},
          {"roofline_flops", s.roofline_flops}, {"ratio", s.ratio}, {"touched_experts", s.touched_experts},
          {"streamed_bytes", s.streamed_bytes}, {"copy_floor_ms", s.copy_floor_ms},
          {"prefetched_experts", s.prefetched_experts}, {"prefetch_hits", s.prefetch_hits},
          {"replays", s.replays}, {"n_ops", s.n_ops}, {"ops", ops}, {"ops_in_graph", s.ops_in_graph},
          {"small_ops_ms", s.small_ops_ms}, {"op_overhead_us", s.op_overhead_us},
          {"small_ops_us_per_layer", s.small_ops_us_per_layer}};
}

json prefill_json(const PrefillResult& p) {
  return {{"model", p.model}, {"prompt_tokens", p.prompt_tokens}, {"chunk_tokens", p.chunk_tokens},
          {"seconds", p.seconds}, {"tokens_per_s", p.tokens_per_s}, {"roofline_tokens_per_s", p.roofline_tokens_per_s},
          {"flops", p.flops}, {"ratio", p.ratio}, {"peak_device_bytes", p.peak_device_bytes},
          {"peak_pool_bytes", p.peak_pool_bytes}, {"peak_in_use_bytes", p.peak_in_use_bytes},
          {"device_total_bytes", p.device_total_bytes},
          {"peak_rss_bytes", p.peak_rss_bytes}, {"decoded_ids", p.decoded_ids}, {"decode_margins", p.decode_margins},
          {"decode_ms_per_token", p.decode_ms_per_token}, {"paths", p.paths}, {"chunk_ms", p.chunk_ms}};
}

json host_json(const HostResult& h) {
  json batches = json::array();
  for (const auto& b : h.batches) {
    batches.push_back({{"batch", b.batch}, {"context", b.context}, {"upload_ms", b.upload_ms},
                       {"logits_d2h_ms", b.logits_d2h_ms}, {"sample_greedy_ms", b.sample_greedy_ms},
                       {"sample_top_p_ms", b.sample_top_p_ms}, {"sampled_rows", b.sampled_rows},
                       {"step_sample_greedy_ms", b.step_sample_greedy_ms},
                       {"step_sample_top_p_ms", b.step_sample_top_p_ms}, {"engine_step_ms", opt(b.engine_step_ms)},
                       {"engine_step_top_p_ms", opt(b.engine_step_top_p_ms)}});
  }
  return {{"model", h.model}, {"vocab", h.vocab}, {"batches", batches}};
}

std::string num(const std::optional<double>& v, const char* spec = "{:.1f}") {
  return v ? fmt::format(fmt::runtime(spec), *v) : std::string("-");
}

}  // namespace

json to_json(const BenchReport& r) {
  json kernels = json::array(), steps = json::array(), prefill = json::array();
  for (const auto& k : r.kernels) kernels.push_back(kernel_json(k));
  for (const auto& s : r.steps) steps.push_back(step_json(s));
  for (const auto& p : r.prefill) prefill.push_back(prefill_json(p));
  json exchange = json::array();
  for (const auto& e : r.exchange) {
    exchange.push_back({{"exchange", e.exchange}, {"ranks", e.ranks}, {"tokens_per_rank", e.tokens_per_rank},
                        {"top_k", e.top_k}, {"hidden", e.hidden}, {"experts", e.experts},
                        {"dispatch_us", e.dispatch_us}, {"combine_us", e.combine_us},
                        {"dispatch_gb_s", e.dispatch_gb_s}, {"combine_gb_s", e.combine_gb_s},
                        {"shared_gpu", e.shared_gpu}});
  }
  return {{"schema", 1},
          {"commit", r.commit},
          {"date", r.date},
          {"command", r.command},
          {"env", r.env},
          {"quick", r.quick},
          {"gpu", r.device.device == "cuda" ? json(r.device.name) : json(nullptr)},
          {"driver", opt(r.device.driver)},
          {"device", device_json(r.device)},
          {"clocks", clocks_json(r.device)},
          {"ceilings", ceilings_json(r.ceilings)},
          {"kernels", kernels},
          {"steps", steps},
          {"prefill", prefill},
          {"host", r.host ? host_json(*r.host) : json(nullptr)},
          {"exchange", exchange},
          {"errors", r.errors}};
}

std::string format_table(const BenchReport& r) {
  const Ceilings& c = r.ceilings;
  std::string out = fmt::format("batchgen bench  {}  {}  {} ({})  driver {}\n", r.commit, r.date, r.device.name,
                                r.device.device, r.device.driver.value_or("-"));
  if (!r.env.empty()) {
    out += "env:";
    for (const auto& [name, value] : r.env) out += fmt::format(" {}={}", name, value);
    out += "\n";
  }
  out += fmt::format("ceilings: read {} GB/s, copy {} GB/s, gemm bf16 {} / fp8 {} / f32 {} TFLOP/s, h2d {} d2h {} "
                     "GB/s, graph node {} us\n",
                     num(c.read_gbps, "{:.0f}"), num(c.copy_gbps, "{:.0f}"), num(c.gemm_bf16_tflops),
                     num(c.gemm_fp8_tflops), num(c.gemm_f32_tflops, "{:.3f}"), num(c.h2d_gbps), num(c.d2h_gbps),
                     num(c.graph_node_us, "{:.2f}"));
  for (const auto& g : c.grouped_gemm_bf16) {
    out += fmt::format("  grouped bf16, {:5} rows/expert: {:8.3f} ms {:7.1f} TFLOP/s {:6.0f} GB/s ({})\n",
                       g.rows_per_expert, g.ms, g.tflops, g.gbps, g.api);
  }
  if (!r.kernels.empty()) {
    out += fmt::format("\n{:<34} {:<22} {:>10} {:>9} {:>8} {:>8} {:>8} {:>5} {:>5}\n", "kernel", "shape", "ms",
                       "GB/s", "TFLOP/s", "fraction", "bound", "regs", "occ");
    for (const auto& k : r.kernels) {
      if (k.error) {
        out += fmt::format("{:<34} {:<22} error: {}\n", k.name, k.shape, *k.error);
        continue;
      }
      out += fmt::format("{:<34} {:<22} {:>10.4f} {:>9.0f} {:>8.1f} {:>8.3f} {:>8} {:>5} {:>5}\n", k.name, k.shape,
                         k.ms, k.gbps, k.tflops, k.fraction, k.bound,
                         k.registers ? std::to_string(*k.registers) : "-",
                         k.occupancy ? std::to_string(*k.occupancy) : "-");
    }
  }
  if (!r.steps.empty()) {
    // small us/layer: the small ops of one instrumented step per decoder layer, net of the events' own cost
    // (op_profiler.h SmallOps; 'g': timed inside a graph).
    out += fmt::format("\n{:<16} {:>6} {:>8} {:>10} {:>10} {:>11} {:>7} {:>8} {:>15}  top ops\n", "step", "batch",
                       "context", "ms", "wall ms", "roofline ms", "ratio", "experts", "small us/layer");
    for (const auto& s : r.steps) {
      std::string top;
      for (size_t i = 0; i < s.ops.size() && i < 3; ++i) {
        top += fmt::format("{}{} {:.0f}%", i ? ", " : "", s.ops[i].name, 100.0 * s.ops[i].share);
      }
      const std::string small = fmt::format("{:.1f}{}", s.small_ops_us_per_layer, s.ops_in_graph ? " g" : "");
      out += fmt::format("{:<16} {:>6} {:>8} {:>10.3f} {:>10.3f} {:>11.3f} {:>7.2f} {:>8.1f} {:>15}  {}\n", s.model,
                         s.batch, s.context, s.ms, s.wall_ms, s.roofline_ms, s.ratio, s.touched_experts, small, top);
      if (s.streamed_bytes > 0) {
        out += fmt::format("{:<16} {:>6} {:>8}   streamed experts: {:.2f} MB copied a step", "", "", "",
                           s.streamed_bytes / 1e6);
        if (s.copy_floor_ms > 0) {
          out += fmt::format(", {:.3f} ms at the pinned H2D rate (step / (roofline + copy floor) = {:.2f}x)",
                             s.copy_floor_ms, s.ms / (s.roofline_ms + s.copy_floor_ms));
        }
        out += fmt::format("; {:.1f} experts prefetched, {:.1f} of them used", s.prefetched_experts, s.prefetch_hits);
        out += "\n";
      }
    }
  }
  if (!r.prefill.empty()) {
    out += fmt::format("\n{:<16} {:>8} {:>8} {:>10} {:>12} {:>14} {:>7} {:>9} {:>8}\n", "prefill", "tokens", "chunk",
                       "seconds", "tokens/s", "roofline tok/s", "ratio", "device GB", "rss GB");
    for (const auto& p : r.prefill) {
      out += fmt::format("{:<16} {:>8} {:>8} {:>10.3f} {:>12.1f} {:>14.1f} {:>7.2f} {:>9.2f} {:>8.2f}\n", p.model,
                         p.prompt_tokens, p.chunk_tokens, p.seconds, p.tokens_per_s, p.roofline_tokens_per_s, p.ratio,
                         p.peak_device_bytes / 1e9, p.peak_rss_bytes / 1e9);
    }
    for (const auto& p : r.prefill) {
      if (p.chunk_ms.size() < 2) continue;
      out += fmt::format("{:<16} {:>8} chunk ms [{:.1f}]\n", p.model, p.prompt_tokens, fmt::join(p.chunk_ms, " "));
    }
    for (const auto& p : r.prefill) {
      if (p.decoded_ids.empty()) continue;
      out += fmt::format("{:<16} {:>8} decoded [{}] margins [{:.3f}] {:.2f} ms/token\n", p.model, p.prompt_tokens,
                         fmt::join(p.decoded_ids, ","), fmt::join(p.decode_margins, ","), p.decode_ms_per_token);
    }
  }
  if (r.host) {
    // cpu greedy / top_p: the CPU sampler per step; step greedy / top_p: Backend::sample_rows (the engine's path).
    out += fmt::format("\n{:<16} {:>6} {:>10} {:>10} {:>11} {:>11} {:>11} {:>11} {:>12} {:>12}\n", "host", "batch",
                       "upload ms", "d2h ms", "cpu greedy", "cpu top_p", "step greedy", "step top_p", "engine step",
                       "engine top_p");
    for (const auto& b : r.host->batches) {
      out += fmt::format("{:<16} {:>6} {:>10.3f} {:>10.3f} {:>11.3f} {:>11.3f} {:>11.3f} {:>11.3f} {:>12} {:>12}\n",
                         r.host->model, b.batch, b.upload_ms, b.logits_d2h_ms, b.sample_greedy_ms, b.sample_top_p_ms,
                         b.step_sample_greedy_ms, b.step_sample_top_p_ms, num(b.engine_step_ms, "{:.3f}"),
                         num(b.engine_step_top_p_ms, "{:.3f}"));
    }
  }
  if (!r.exchange.empty()) {
    out += fmt::format("\n{:<10} {:>6} {:>8} {:>6} {:>7} {:>8} {:>12} {:>12} {:>12} {:>12}\n", "exchange", "ranks",
                       "tokens", "top_k", "hidden", "experts", "dispatch us", "combine us", "dispatch GB/s",
                       "combine GB/s");
    for (const auto& e : r.exchange) {
      out += fmt::format("{:<10} {:>6} {:>8} {:>6} {:>7} {:>8} {:>12.1f} {:>12.1f} {:>12.1f} {:>12.1f}\n",
                         e.exchange + (e.shared_gpu ? "*" : ""), e.ranks, e.tokens_per_rank, e.top_k, e.hidden,
                         e.experts, e.dispatch_us, e.combine_us, e.dispatch_gb_s, e.combine_gb_s);
    }
    out += "(* every rank on this one GPU: a regression guard, not a multi-GPU figure)\n";
  }
  for (const auto& e : r.errors) out += "\nFAILED: " + e + "\n";
  return out;
}

}  // namespace bg::bench

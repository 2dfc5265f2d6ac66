// `batchgen bench kernels|step|prefill|all|exchange`: ceilings, kernels, decode steps, prefill and the host side as fractions of
// ceilings measured in the same run; a short table on stdout, everything in --json (docs/PERF.md).
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "bench/bench.h"
#include "core/error.h"
#include "tools/cli_util.h"
#include "tools/commands.h"

namespace bg::tools {
namespace {

struct BenchArgs {
  bench::BenchOptions options;
  std::string json_path;
  std::string batches, contexts, prefill_tokens, exchange_ranks, exchange_tokens;
};

std::vector<int64_t> parse_sizes(const std::string& text, const std::string& flag) {
  std::vector<int64_t> out;
  if (text.empty()) return out;
  for (int32_t v : parse_id_list(text, flag)) out.push_back(v);
  return out;
}

// The command line as run (the report names it).
std::string command_line(const BenchArgs& a) {
  const bench::BenchOptions& o = a.options;
  std::string cmd = fmt::format("batchgen bench {} --device {}", o.what, o.device);
  if (o.quick) cmd += " --quick";
  if (o.deterministic) cmd += " --deterministic";
  for (const auto& m : o.models) cmd += " --model " + m.string();
  if (!a.batches.empty()) cmd += " --batches " + a.batches;
  if (!a.contexts.empty()) cmd += " --contexts " + a.contexts;
  if (!a.prefill_tokens.empty()) cmd += " --prefill-tokens " + a.prefill_tokens;
  if (!a.exchange_ranks.empty()) cmd += " --ranks " + a.exchange_ranks;
  if (!a.exchange_tokens.empty()) cmd += " --exchange-tokens " + a.exchange_tokens;
  if (o.prefill_chunk > 0) cmd += fmt::format(" --prefill-chunk {}", o.prefill_chunk);
  if (o.decode_tokens > 0) cmd += fmt::format(" --decode-tokens {}", o.decode_tokens);
  if (o.replays > 0) cmd += fmt::format(" --replays {}", o.replays);
  if (!o.kernel_filter.empty()) cmd += " --kernels " + o.kernel_filter;
  if (o.resident_experts < 1.0) cmd += fmt::format(" --resident-experts {}", o.resident_experts);
  if (!o.expert_trace.empty()) cmd += " --expert-trace " + o.expert_trace;
  if (!a.json_path.empty()) cmd += " --json " + a.json_path;
  return cmd;
}

void run(BenchArgs a) {
  a.options.batches = parse_sizes(a.batches, "--batches");
  a.options.contexts = parse_sizes(a.contexts, "--contexts");
  a.options.prefill_tokens = parse_sizes(a.prefill_tokens, "--prefill-tokens");
  a.options.exchange_ranks = parse_sizes(a.exchange_ranks, "--ranks");
  a.options.exchange_tokens = parse_sizes(a.exchange_tokens, "--exchange-tokens");
  a.options.command = command_line(a);
  const std::filesystem::path json_path = a.json_path;
  const std::filesystem::path tmp_path = json_path.string() + ".tmp";
  if (!a.json_path.empty()) {  // fail before minutes of measuring, not after
    std::ofstream probe(tmp_path, std::ios::trunc);
    BG_CHECK(probe.good(), "--json: cannot write '{}'", tmp_path.string());
  }
  bench::BenchReport report;
  try {
    report = bench::run_bench(a.options);
  } catch (...) {
    std::error_code ec;  // keep the measurement's error, not a cleanup error
    if (!a.json_path.empty()) std::filesystem::remove(tmp_path, ec);
    throw;
  }
  std::fputs(bench::format_table(report).c_str(), stdout);
  std::fflush(stdout);
  if (a.json_path.empty()) {
    BG_CHECK(report.errors.empty(), "bench: {} part(s) failed: {}", report.errors.size(), report.errors.front());
    return;
  }
  {
    std::ofstream out(tmp_path, std::ios::trunc);
    out << bench::to_json(report).dump(2) << "\n";
    out.close();
    BG_CHECK(out.good(), "--json: writing '{}' failed", tmp_path.string());
  }
  std::filesystem::rename(tmp_path, json_path);
  BG_CHECK(report.errors.empty(), "bench: {} part(s) failed (the report has everything else): {}",
           report.errors.size(), report.errors.front());
}

}  // namespace

void register_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  bench::BenchOptions& o = args->options;
  auto* cmd = app.add_subcommand("bench", "Measure ceilings, kernels, decode steps, prefill and the host side "
                                          "(docs/PERF.md)");
  cmd->add_option("part", o.what, "What to run: kernels, step (steps + host side), prefill, all (the four), or "
                  "exchange (the ll expert exchange between rank threads on this GPU)")
      ->required()
      ->check(CLI::IsMember({"kernels", "step", "prefill", "all", "exchange"}));
  cmd->add_option("--device", o.device, "cuda (default) or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  cmd->add_option("--json", args->json_path, "Write the full report as JSON to this file");
  cmd->add_flag("--deterministic", o.deterministic, "Step and prefill with batch-invariant kernels (the cost of "
               "serve --deterministic)");
  cmd->add_flag("--quick", o.quick, "Smaller sizes and fewer repeats (CI runs `bench all --device cpu --quick`)");
  cmd->add_option("--model", o.models,
                  "Checkpoint for step / prefill (repeatable); default on the CPU: tiny K3 and DeepSeek-V3 presets")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--batches", args->batches, "Decode batches, e.g. 1,16,64,256");
  cmd->add_option("--contexts", args->contexts, "Fabricated contexts in tokens, e.g. 4096,32768");
  cmd->add_option("--prefill-tokens", args->prefill_tokens, "Prompt lengths, e.g. 4096,8192,16384,65536");
  cmd->add_option("--prefill-chunk", o.prefill_chunk, "Tokens per prefill step (default: the scheduler's default)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--decode-tokens", o.decode_tokens,
                  "prefill: greedy tokens generated after each prompt; their ids and top-1 margins are reported, so "
                  "runs of the same prompt on two devices can be compared (default 0)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--replays", o.replays, "Timed decode steps per point (default 10, quick 3)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kernels", o.kernel_filter,
                  "Only these kernel cases: comma-separated substrings of their names, or NAME$ for one name");
  cmd->add_option("--ranks", args->exchange_ranks, "bench exchange: rank counts, e.g. 2,4,8 (default)");
  cmd->add_option("--exchange-tokens", args->exchange_tokens, "bench exchange: tokens each rank sends per call, e.g. "
                  "1,16,128 (default)");
  add_weight_source_options(cmd, o.weight_store, o.distributed_weight_config);
  add_expert_residency_options(cmd, o.resident_experts, o.expert_trace);
  cmd->callback([args] { run(*args); });
}

}  // namespace bg::tools

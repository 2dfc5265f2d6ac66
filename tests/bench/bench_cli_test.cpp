// `batchgen bench all --device cpu --quick` end to end through the CLI (what CI keeps working): it exits 0, prints
// the table, and writes JSON of the documented shape with every part filled in. No timing is asserted — only that
// each figure was measured (positive, finite) and sits beside its ceiling.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "temp_dir.h"

namespace bg::testing {
namespace {

using nlohmann::json;

struct CommandResult {
  int exit_code = -1;
  std::string stdout_text;
};

// Runs `batchgen <args>` from the build tree, with `env` ("NAME=value ...") added to its environment; stderr goes to
// `log`.
CommandResult run_batchgen(const std::string& args, const std::filesystem::path& log, const std::string& env = "") {
  const std::string cmd =
      (env.empty() ? "" : "env " + env + " ") + std::string(BG_BINARY_DIR) + "/batchgen " + args + " 2>" + log.string();
  CommandResult r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) r.stdout_text.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool positive(const json& v) { return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0; }

void expect_keys(const json& obj, std::initializer_list<const char*> keys, const std::string& where) {
  ASSERT_TRUE(obj.is_object()) << where;
  for (const char* k : keys) EXPECT_TRUE(obj.contains(k)) << where << " lacks '" << k << "'";
}

TEST(BenchCli, CpuQuickWritesTheDocumentedJson) {
  TempDir tmp;
  const auto out = tmp / "cpu.json";
  // A kernel choice in the environment is part of what was measured: the report records the BG_* variables.
  const CommandResult r = run_batchgen("bench all --device cpu --quick --json " + out.string(), tmp / "log.txt",
                                       "BG_MOE_PREFILL=grouped");
  ASSERT_EQ(r.exit_code, 0) << read_text(tmp / "log.txt");
  EXPECT_NE(r.stdout_text.find("ceilings:"), std::string::npos) << r.stdout_text;
  EXPECT_NE(r.stdout_text.find("env: "), std::string::npos) << r.stdout_text;
  EXPECT_NE(r.stdout_text.find(" BG_MOE_PREFILL=grouped"), std::string::npos) << r.stdout_text;
  EXPECT_NE(r.stdout_text.find("roofline ms"), std::string::npos) << r.stdout_text;
  const json j = json::parse(read_text(out));
  expect_keys(j, {"schema", "commit", "date", "command", "env", "gpu", "driver", "device", "clocks", "ceilings",
                  "kernels", "steps", "prefill", "host", "exchange", "errors"},
              "report");
  ASSERT_TRUE(j["env"].is_object()) << j["env"].dump();
  EXPECT_EQ(j["env"]["BG_MOE_PREFILL"], "grouped") << j["env"].dump();
  for (const auto& [name, value] : j["env"].items()) {
    EXPECT_EQ(name.rfind("BG_", 0), 0u) << name << ": only BG_* variables are recorded";
    EXPECT_TRUE(value.is_string()) << name;
  }
  EXPECT_EQ(j["exchange"], json::array());  // bench exchange only
  EXPECT_TRUE(j["commit"].is_string() && !j["commit"].get<std::string>().empty());
  EXPECT_EQ(j["errors"], json::array());
  EXPECT_EQ(j["gpu"], nullptr);
  EXPECT_EQ(j["driver"], nullptr);
  EXPECT_EQ(j["device"]["device"], "cpu");
  expect_keys(j["clocks"], {"sm_mhz", "mem_mhz"}, "clocks");
  const json& c = j["ceilings"];
  expect_keys(c, {"read_gbps", "copy_gbps", "gemm_bf16_tflops", "gemm_fp8_tflops", "gemm_f32_tflops",
                  "grouped_gemm_bf16", "h2d_gbps", "graph_node_us"},
              "ceilings");
  EXPECT_TRUE(positive(c["read_gbps"]) && positive(c["copy_gbps"]) && positive(c["gemm_f32_tflops"]));
  EXPECT_EQ(c["gemm_bf16_tflops"], nullptr);  // CPU: no bf16 GEMM ceiling, the f32 one is the reference

  ASSERT_TRUE(j["kernels"].is_array() && !j["kernels"].empty());
  for (const json& k : j["kernels"]) {
    expect_keys(k, {"name", "shape", "ms", "gbps", "tflops", "fraction", "bound", "registers", "smem", "occupancy"},
                "kernel");
    EXPECT_TRUE(positive(k["ms"]) && positive(k["fraction"])) << k.dump();
    EXPECT_TRUE(k["bound"] == "memory" || k["bound"] == "compute") << k.dump();
  }

  // Two tiny models x batches {1, 4} x contexts {64, 200}; each step beside its roofline, with a per-op breakdown.
  ASSERT_EQ(j["steps"].size(), 8u);
  std::set<std::string> models;
  for (const json& s : j["steps"]) {
    expect_keys(s, {"model", "batch", "context", "ms", "wall_ms", "roofline_ms", "ratio", "ops", "touched_experts"},
                "step");
    models.insert(s["model"].get<std::string>());
    EXPECT_TRUE(positive(s["ms"]) && positive(s["roofline_ms"]) && positive(s["ratio"])) << s.dump();
    EXPECT_GE(s["wall_ms"].get<double>(), s["ms"].get<double>() * 0.5) << s.dump();
    std::set<std::string> ops;
    double share = 0;
    for (const json& o : s["ops"]) {
      ops.insert(o["name"].get<std::string>());
      share += o["share"].get<double>();
    }
    EXPECT_TRUE(ops.count("linear") && ops.count("mla_attention") && ops.count("moe_experts")) << s.dump();
    EXPECT_NEAR(share, 1.0, 1e-6);
    EXPECT_TRUE(positive(s["touched_experts"])) << s.dump();
    EXPECT_EQ(s["streamed_bytes"], 0.0) << "every expert is resident by default: " << s.dump();
  }
  EXPECT_EQ(models, (std::set<std::string>{"kimi_k3-tiny", "deepseek_v3-tiny"}));

  ASSERT_EQ(j["prefill"].size(), 4u);
  for (const json& p : j["prefill"]) {
    expect_keys(p, {"prompt_tokens", "chunk_tokens", "tokens_per_s", "roofline_tokens_per_s", "paths", "chunk_ms"},
                "prefill");
    EXPECT_EQ(p["paths"], json::object()) << "the CPU backend has one path per op: " << p.dump();
    // One wall time per chunk, together about the prompt's.
    const auto prompt = p["prompt_tokens"].get<int64_t>(), chunk = p["chunk_tokens"].get<int64_t>();
    ASSERT_EQ(p["chunk_ms"].size(), static_cast<size_t>((prompt + chunk - 1) / chunk)) << p.dump();
    double chunks = 0;
    for (const json& ms : p["chunk_ms"]) {
      EXPECT_TRUE(positive(ms)) << p.dump();
      chunks += ms.get<double>();
    }
    EXPECT_LE(chunks, p["seconds"].get<double>() * 1000.0 * 1.001 + 0.01) << p.dump();
    EXPECT_TRUE(positive(p["tokens_per_s"]) && positive(p["roofline_tokens_per_s"])) << p.dump();
  }

  const json& h = j["host"];
  expect_keys(h, {"model", "vocab", "batches"}, "host");
  ASSERT_EQ(h["batches"].size(), 2u);
  for (const json& b : h["batches"]) {
    expect_keys(b, {"batch", "upload_ms", "logits_d2h_ms", "sample_greedy_ms", "sample_top_p_ms",
                    "step_sample_greedy_ms", "step_sample_top_p_ms", "engine_step_ms", "engine_step_top_p_ms"},
                "host batch");
    EXPECT_TRUE(positive(b["sample_top_p_ms"]) && positive(b["engine_step_ms"])) << b.dump();
    EXPECT_TRUE(positive(b["step_sample_top_p_ms"]) && positive(b["engine_step_top_p_ms"])) << b.dump();
  }
}

// --resident-experts below 1: each step reports the bytes its streamed experts copied (with every expert streamed,
// the pool of two layers' worth cannot keep the tiny models' routed experts between steps) and the experts
// prefetched for the next layer, and the table says so.
TEST(BenchCli, StreamedExpertsReportTheirCopiesPerStep) {
  TempDir tmp;
  const auto out = tmp / "stream.json";
  const CommandResult r = run_batchgen("bench step --device cpu --quick --resident-experts 0 --json " + out.string(),
                                       tmp / "log.txt");
  ASSERT_EQ(r.exit_code, 0) << read_text(tmp / "log.txt");
  EXPECT_NE(r.stdout_text.find("streamed experts:"), std::string::npos) << r.stdout_text;
  const json j = json::parse(read_text(out));
  ASSERT_FALSE(j["steps"].empty());
  double prefetch_hits = 0;
  for (const json& s : j["steps"]) {
    expect_keys(s, {"streamed_bytes", "copy_floor_ms", "prefetched_experts", "prefetch_hits"}, "step");
    EXPECT_TRUE(positive(s["streamed_bytes"])) << s.dump();
    prefetch_hits += s["prefetch_hits"].get<double>();
  }
  EXPECT_GT(prefetch_hits, 0.0);
  EXPECT_NE(r.stdout_text.find("experts prefetched"), std::string::npos) << r.stdout_text;
}

// bench-multiturn on the tiny K3 golden model: the cache off computes every prompt token, the cache on reuses the
// shared system prompt and earlier turns, the outputs are identical (--deterministic, as the H200 run), and part 2
// generates every requested token without and with the host tier.
TEST(BenchCli, MultiturnReportsTheCacheAndTheHostTier) {
  TempDir tmp;
  const auto out = tmp / "multiturn.json";
  const std::string model = (std::filesystem::path(BG_GOLDEN_DIR) / "kimi_k3/k3-tiny/model").string();
  const CommandResult r = run_batchgen(
      "bench-multiturn --model " + model + " --conversations 3 --turns 3 --system-tokens 160 --user-tokens 8 "
      "--reply-tokens 4 --max-model-len 512 --prefix-snapshot-interval 64 --deterministic --concurrency-requests 8 "
      "--concurrency-prompt 64 --concurrency-tokens 8 --kv-cache-memory-bytes 2000000 --host-memory-gb 0.05 --json " +
          out.string(),
      tmp / "log.txt");
  ASSERT_EQ(r.exit_code, 0) << read_text(tmp / "log.txt");
  const json j = json::parse(read_text(out));
  const json& m = j["multiturn"];
  EXPECT_EQ(m["deterministic"], true);
  EXPECT_EQ(m["outputs_identical"], true) << m.dump();
  EXPECT_EQ(m["cache_off"]["cached_tokens"], 0) << m.dump();
  EXPECT_GT(m["cache_on"]["cached_tokens"].get<int64_t>(), 128) << m.dump();
  EXPECT_EQ(m["cache_off"]["prompt_tokens"], m["cache_on"]["prompt_tokens"]);
  EXPECT_LT(m["cache_on"]["prefill_tokens_computed"].get<int64_t>(),
            m["cache_off"]["prefill_tokens_computed"].get<int64_t>()) << m.dump();
  for (const char* part : {"gpu_only", "host_tier"}) {
    const json& c = j["concurrency"][part];
    EXPECT_EQ(c["requests"], 8) << part;
    EXPECT_EQ(c["generated_tokens"], 8 * 8) << part;
    EXPECT_GE(c["most_in_flight"].get<int64_t>(), 1) << part;
  }
}

TEST(BenchCli, BadRequestsAreClearErrors) {
  TempDir tmp;
  CommandResult r = run_batchgen("bench step --device cpu --quick --contexts 100000", tmp / "a.txt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(read_text(tmp / "a.txt").find("max_position_embeddings"), std::string::npos) << read_text(tmp / "a.txt");
  r = run_batchgen("bench nonsense --device cpu --quick", tmp / "b.txt");
  EXPECT_NE(r.exit_code, 0);
  r = run_batchgen("bench exchange --device cpu", tmp / "d.txt");  // the ll exchange is CUDA's
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(read_text(tmp / "d.txt").find("runs on CUDA"), std::string::npos) << read_text(tmp / "d.txt");
  r = run_batchgen("bench all --device cpu --quick --json /nonexistent-dir/x.json", tmp / "c.txt");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(read_text(tmp / "c.txt").find("--json"), std::string::npos) << read_text(tmp / "c.txt");
}

}  // namespace
}  // namespace bg::testing

// The pieces `batchgen bench` stands on, on the CPU: the backend's per-op profiler hook sees every op of a step by
// name; fabricated contexts fill KV blocks and KDA state and decode on from them; the roofline's byte model counts
// each routed expert exactly as stored; the op-record reductions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "bench/bench.h"
#include "bench/model_bench.h"
#include "bench/op_profiler.h"
#include "bench/roofline.h"
#include "formats/checkpoint.h"
#include "kv/state_manager.h"
#include "model/fabricate_context.h"
#include "model/model_testing.h"
#include "model/random_checkpoint.h"

namespace bg::testing {
namespace {

std::filesystem::path tiny(const TempDir& tmp, const std::string& arch) {
  RandomCheckpointSpec s;
  s.arch = arch;
  s.preset = "tiny";
  s.seed = 3;
  s.out_dir = tmp / arch;
  write_random_checkpoint(s);
  return s.out_dir;
}

TEST(KernelFilter, SubstringsAndExactNamesSeparatedByCommas) {
  EXPECT_TRUE(bench::kernel_case_matches("mla_prefill_wgmma", ""));
  EXPECT_TRUE(bench::kernel_case_matches("mla_prefill_wgmma", "mla_prefill"));
  EXPECT_FALSE(bench::kernel_case_matches("mla_prefill_wgmma", "mla_prefill$"));
  EXPECT_TRUE(bench::kernel_case_matches("mla_prefill", "mla_prefill$"));
  EXPECT_TRUE(bench::kernel_case_matches("mla_prefill_attention", "mla_prefill$,attention"));
  EXPECT_TRUE(bench::kernel_case_matches("rmsnorm_decode", "attention,rmsnorm"));
  EXPECT_FALSE(bench::kernel_case_matches("rmsnorm_decode", "attention,,mla"));
  EXPECT_FALSE(bench::kernel_case_matches("rmsnorm_decode", ","));
  EXPECT_FALSE(bench::kernel_case_matches("rmsnorm_decode", "$"));
}

TEST(OpProfilerHook, SeesEveryOpOfAStepByName) {
  TempDir tmp;
  auto model = load_model(tiny(tmp, "kimi_k3"));
  auto state = make_state(*model, 1, 64);
  auto seq = state->new_sequence(64);
  std::vector<int32_t> prompt = {3, 5, 7, 11};
  std::vector<float> logits(4 * static_cast<size_t>(model->info().vocab_size));
  auto profiler = bench::make_wall_profiler(true);
  model->backend().set_profiler(profiler.get());
  model->forward(*seq, prompt, logits.data());
  model->backend().set_profiler(nullptr);
  const std::vector<bench::OpRecord> records = profiler->take();
  std::set<std::string> names;
  for (const auto& r : records) {
    names.insert(r.name);
    EXPECT_EQ(r.depth, 0) << r.name;  // backend ops do not nest
    EXPECT_GE(r.end_ms, r.begin_ms) << r.name;
  }
  for (const char* op : {"embedding", "rmsnorm", "linear", "attn_res_mix", "short_conv", "kda", "mla_write",
                         "mla_attention", "route", "moe_dispatch", "moe_experts", "moe_combine", "download_f32"}) {
    EXPECT_TRUE(names.count(op)) << op;
  }
  // Detached: nothing more is recorded.
  model->forward(*seq, std::span<const int32_t>(prompt).subspan(0, 1), logits.data());
  EXPECT_TRUE(profiler->take().empty());
}

TEST(OpRecords, SpanAndAggregation) {
  const std::vector<bench::OpRecord> records = {
      {"upload_step", 0, 0.0, 1.0}, {"linear", 0, 1.0, 3.0}, {"rmsnorm", 0, 3.0, 3.5},
      {"linear", 0, 4.0, 5.0},      {"inner", 1, 4.2, 4.4},  {"download_f32", 0, 5.0, 9.0}};
  EXPECT_DOUBLE_EQ(bench::step_span_ms(records), 4.0);  // linear 1.0 .. linear 5.0; host-side ops left out
  const std::vector<bench::OpTime> ops = bench::aggregate_ops(records);
  ASSERT_EQ(ops.size(), 4u);
  EXPECT_EQ(ops[0].name, "download_f32");
  EXPECT_EQ(ops[1].name, "linear");
  EXPECT_EQ(ops[1].calls, 2);
  EXPECT_DOUBLE_EQ(ops[1].ms, 3.0);
  EXPECT_DOUBLE_EQ(ops[1].share, 3.0 / 8.5);
}

// The small ops are everything but GEMMs, attention and the host side; the events' excess over the un-instrumented
// step is spread evenly over the step's ops and taken off the small ones.
TEST(OpProfiler, SmallOpsNetOfTheInstrumentation) {
  EXPECT_TRUE(bench::small_op("rmsnorm"));
  EXPECT_TRUE(bench::small_op("kda_prep"));
  for (const char* big : {"linear", "moe_routed_local", "moe_experts", "mla_attention", "kda", "sample_rows",
                          "upload_step", "download_f32", "graph"}) {
    EXPECT_FALSE(bench::small_op(big)) << big;
  }
  const std::vector<bench::OpTime> ops = {{"linear", 2, 3.0, 0}, {"rmsnorm", 4, 0.5, 0}, {"add", 2, 0.1, 0},
                                          {"upload_step", 1, 9.0, 0}, {"sample_rows", 1, 9.0, 0}};
  // Step spans 3.6 ms over 8 step ops against a 3.2 ms step: 0.05 ms of events per op.
  const bench::SmallOps s = bench::small_ops(ops, 3.2);
  EXPECT_EQ(s.calls, 6);
  EXPECT_DOUBLE_EQ(s.raw_ms, 0.6);
  EXPECT_NEAR(s.overhead_us, 50.0, 1e-9);
  EXPECT_NEAR(s.net_ms, 0.3, 1e-12);
  // A step no faster than its spans has no overhead to take off; the net never goes negative.
  EXPECT_DOUBLE_EQ(bench::small_ops(ops, 5.0).net_ms, 0.6);
  EXPECT_DOUBLE_EQ(bench::small_ops({{"add", 100, 0.1, 0}, {"linear", 1, 1.0, 0}}, 0.01).net_ms, 0.0);
}

// Decoding after a fabricated context equals decoding after a real one in everything but values: the sequence
// holds n tokens of blocks, its KDA state is filled, and steps run on from position n with finite logits.
TEST(FabricateContext, FillsBlocksAndStateAndDecodesOn) {
  TempDir tmp;
  for (const char* arch : {"kimi_k3", "deepseek_v3"}) {
    auto model = load_model(tiny(tmp, arch));
    auto state = make_state(*model, 3, 512);
    auto seq = state->new_sequence();
    fabricate_sequence_context(*state, *seq, 100, 9);
    state->reserve(*seq, 101);
    EXPECT_EQ(seq->n_past(), 100) << arch;
    EXPECT_EQ(seq->kv_blocks().size(), 2u) << arch;  // 64-token blocks
    std::vector<float> logits(static_cast<size_t>(model->info().vocab_size));
    const int32_t token = 5;
    const BatchEntry entry{seq.get(), std::span<const int32_t>(&token, 1)};
    model->forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
    EXPECT_TRUE(all_finite(logits)) << arch;
    EXPECT_EQ(seq->n_past(), 101) << arch;
    // The context changes the result: a fresh sequence at position 0 gives other logits.
    auto fresh = state->new_sequence(1);
    std::vector<float> fresh_logits(logits.size());
    const BatchEntry e2{fresh.get(), std::span<const int32_t>(&token, 1)};
    model->forward_batch(std::span<const BatchEntry>(&e2, 1), fresh_logits.data());
    EXPECT_NE(logits, fresh_logits) << arch;
    // Only an empty sequence can be fabricated; a pool too small is an error naming it.
    EXPECT_NE(bg_error_of([&] { fabricate_sequence_context(*state, *seq, 10, 1); }).find("already holds"),
              std::string::npos);
    auto big = state->new_sequence();
    EXPECT_NE(bg_error_of([&] { fabricate_sequence_context(*state, *big, 100000, 1); }).find("full"),
              std::string::npos);
  }
}

// The step byte model: the difference between all experts touched and none is exactly the stored bytes of every
// routed expert of every MoE layer (read from the checkpoint here independently), and KV bytes grow with context.
TEST(StepCostModel, CountsStoredExpertBytesAndKv) {
  TempDir tmp;
  const auto dir = tiny(tmp, "kimi_k3");
  const bench::StepCostModel cost = bench::StepCostModel::load(dir, 2);
  bench::Ceilings c;
  c.read_gbps = 1000.0;
  c.gemm_bf16_tflops = 100.0;
  const std::vector<double> none(static_cast<size_t>(cost.n_moe_layers()), 0.0);
  const bench::StepCost all = cost.decode_step(1, 64, {}, c), zero = cost.decode_step(1, 64, none, c);
  auto ckpt = Checkpoint::open(dir);
  double expert_bytes = 0;
  for (const std::string& name : ckpt->names()) {
    if (name.find(".experts.") != std::string::npos) expert_bytes += static_cast<double>(ckpt->get(name).nbytes);
  }
  ASSERT_GT(expert_bytes, 0);
  EXPECT_DOUBLE_EQ(all.bytes - zero.bytes, expert_bytes);
  EXPECT_GT(all.roofline_ms, zero.roofline_ms);
  const bench::StepCost longer = cost.decode_step(1, 1064, {}, c);
  // 4 MLA layers x 1000 more tokens x (32 + 16) values x 2 bytes.
  EXPECT_DOUBLE_EQ(longer.bytes - all.bytes, 4.0 * 1000 * 48 * 2);
  EXPECT_GT(cost.prefill_chunk(0, 64, c).flops, 0.0);
  EXPECT_GT(cost.prefill_chunk(64, 64, c).flops, cost.prefill_chunk(0, 64, c).flops);  // more keys per query
}

// bench prefill --decode-tokens: the prompt run in chunks and its greedy continuation are what one whole-prompt
// forward and a plain greedy loop over a fresh sequence give (the ids two devices' runs are compared by), the memory
// fields are filled (a host backend has no device figures), and a negative count is refused.
TEST(BenchPrefill, DecodesTheGreedyContinuationOfThePrompt) {
  TempDir tmp;
  const auto dir = tiny(tmp, "kimi_k3");
  auto model = load_model(dir);
  auto state = make_state(*model, 2, 512);
  const bench::StepCostModel cost = bench::StepCostModel::load(dir, 4);
  bench::Ceilings c;
  c.read_gbps = 100.0;
  c.gemm_bf16_tflops = 1.0;
  const int64_t n_prompt = 150, n_decode = 6;
  // Path counts: read before and after the prompt; the paths whose count moved are recorded with the difference.
  uint64_t calls = 0;
  const auto counts = [&calls] {
    calls += 5;
    return std::map<std::string, uint64_t>{{"moved", calls}, {"still", 7}};
  };
  const auto results = bench::bench_prefill(*model, *state, {"tiny", {n_prompt}, 64, n_decode, counts}, cost, c);
  ASSERT_EQ(results.size(), 1u);
  const bench::PrefillResult& r = results[0];
  EXPECT_EQ(r.paths, (std::map<std::string, uint64_t>{{"moved", 5}}));
  ASSERT_EQ(r.decoded_ids.size(), static_cast<size_t>(n_decode));
  ASSERT_EQ(r.decode_margins.size(), static_cast<size_t>(n_decode));
  for (float m : r.decode_margins) EXPECT_GE(m, 0.0f);
  EXPECT_GT(r.decode_ms_per_token, 0.0);
  EXPECT_GT(r.peak_rss_bytes, 0.0);
  EXPECT_EQ(r.peak_device_bytes, 0.0);  // the CPU backend has no device

  const int64_t vocab = model->info().vocab_size;
  const std::vector<int32_t> prompt = bench::bench_prompt(n_prompt, vocab);
  EXPECT_EQ(prompt, bench::bench_prompt(n_prompt, vocab));  // the same prompt on every run
  auto seq = state->new_sequence(n_prompt + n_decode);
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::vector<int32_t> expected;
  std::vector<int32_t> next = prompt;
  for (int64_t i = 0; i < n_decode; ++i) {
    const BatchEntry entry{seq.get(), next};
    model->forward_batch(std::span<const BatchEntry>(&entry, 1), logits.data());
    expected.push_back(static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    next = {expected.back()};
  }
  EXPECT_EQ(r.decoded_ids, expected);
  EXPECT_NE(bg_error_of([&] { bench::bench_prefill(*model, *state, {"tiny", {8}, 64, -1, nullptr}, cost, c); })
                .find("--decode-tokens"),
            std::string::npos);
}

}  // namespace
}  // namespace bg::testing

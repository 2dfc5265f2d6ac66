// Planner arithmetic with numbers: bytes per KV token and per state slot of the tiny Kimi-K3, the split of a budget
// into slots and blocks, the max_model_len cap, the errors, the cuda budget from a stubbed probe, and agreement of
// the plan with the pools the loaded model actually allocates.
#include <gtest/gtest.h>

#include <fstream>

#include "core/error.h"
#include "error_testing.h"
#include "golden/golden_util.h"
#include "model/random_checkpoint.h"
#include "sched/planner.h"
#include "temp_dir.h"

namespace bg::sched {
namespace {

using bg::testing::TempDir;

RandomCheckpointSpec tiny_k3(const std::filesystem::path& dir) {
  RandomCheckpointSpec spec;
  spec.arch = "kimi_k3";
  spec.preset = "tiny";
  spec.out_dir = dir;
  return spec;
}

// config.json only (no shards): the planner reads nothing else.
ModelGeometry tiny_k3_geometry(const TempDir& tmp) {
  std::ofstream(tmp / "config.json") << random_checkpoint_config(tiny_k3(tmp.path())).dump();
  return read_model_geometry(tmp.path());
}

using testing::error_of;

TEST(Planner, TinyKimiK3Geometry) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  EXPECT_EQ(g.arch, "kimi_k3");
  EXPECT_EQ(g.state.n_mla_layers, 4);    // full_attn_layers 3, 6, 9, 10
  EXPECT_EQ(g.state.entry_dim(), 48);    // kv_lora_rank 32 + rope 16
  EXPECT_EQ(g.state.kda.n_kda_layers, 6);
  EXPECT_EQ(g.state.kda.slot_words(4), 6 * (4 * 32 * 32 + 3 * 128 * 3));  // recurrent [4,32,32] + conv 3 x [128, 3]
  EXPECT_EQ(g.state.prefill_align_tokens, 64);                           // the KDA chunk
  EXPECT_EQ(g.max_position_embeddings, 4096);
  EXPECT_EQ(g.weight_bytes, 0);
}

// A TP rank keeps the KDA state of its own heads; the MLA latent cache stays whole (docs/PARALLEL.md).
TEST(Planner, TpRankStateGeometry) {
  TempDir tmp;
  const StateGeometry whole = tiny_k3_geometry(tmp).state;
  const StateGeometry half = tp_state_geometry(whole, 2);
  EXPECT_EQ(half.kda.n_heads, 2);
  EXPECT_EQ(half.kda.conv_channels, 64);
  EXPECT_EQ(half.kda.slot_words(4), 6 * (2 * 32 * 32 + 3 * 64 * 3));
  EXPECT_EQ(half.n_mla_layers, whole.n_mla_layers);
  EXPECT_EQ(half.entry_dim(), whole.entry_dim());
  EXPECT_EQ(tp_state_geometry(whole, 1), whole);
  EXPECT_NE(error_of([&] { tp_state_geometry(whole, 3); }).find("--tp 3 does not divide the 4 KDA heads"),
            std::string::npos);
}

// The rank set agrees on the running sequences' room; this rank's prefix-cache room stays on top of it.
TEST(Planner, RankSetAgreementKeepsThePrefixCacheRoom) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 10 << 20;
  in.max_num_seqs = 2;
  in.max_model_len = 512;
  Plan p = make_plan(g, in);
  ASSERT_GT(p.cache_blocks, 0);
  ASSERT_GT(p.cache_slots, 0);
  const int64_t cache_blocks = p.cache_blocks, cache_slots = p.cache_slots, running = p.running_kv_blocks();
  EXPECT_EQ(running, 2 * 8);  // two sequences of 512 tokens in blocks of 64
  p.agree(1, running - 4, 256);
  EXPECT_EQ(p.max_num_seqs, 1);
  EXPECT_EQ(p.max_model_len, 256);
  EXPECT_EQ(p.running_kv_blocks(), running - 4);
  EXPECT_EQ(p.kv_blocks, running - 4 + cache_blocks);
  EXPECT_EQ(p.state_slots, 1 + cache_slots);
  EXPECT_EQ(p.state_plan().kv_blocks, p.kv_blocks);
  EXPECT_NE(error_of([&] { p.agree(2, 1, 1); }).find("beyond this rank's plan"), std::string::npos);
}

TEST(Planner, SplitsABudgetIntoSlotsAndBlocks) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 10 << 20;  // 10485760
  Plan p = make_plan(g, in);
  EXPECT_EQ(p.act_bytes, 4);
  EXPECT_EQ(p.kv_bytes_per_token, 4 * 48 * 4);         // 768
  EXPECT_EQ(p.state_bytes_per_seq, 31488 * 4);         // 125952
  // Every pool also holds one padding unit (a block, a slot) that no sequence owns.
  EXPECT_EQ(p.max_model_len, 4096);  // the context fits: (64 + 1) blocks x 64 x 768 + 2 x 125952 < 10 MiB
  EXPECT_EQ(p.max_num_seqs, 16);     // the cpu default; (10485760 - 65 x 49152) / 125952 - 1 = 56 would fit
  EXPECT_EQ(p.state_slots, 16);
  EXPECT_EQ(p.kv_blocks, (10485760 - 17 * 125952) / (64 * 768) - 1);  // 168
  EXPECT_EQ(p.kv_bytes(), 169 * 49152);
  EXPECT_EQ(p.state_bytes(), 17 * 125952);
  EXPECT_LE(p.kv_bytes() + p.state_bytes(), in.kv_cache_memory_bytes);
  const kv::StatePlan sp = p.state_plan();
  EXPECT_EQ(sp.state_slots, 16);
  EXPECT_EQ(sp.kv_blocks, 168);
  EXPECT_EQ(sp.kv_block_tokens, 64);
  EXPECT_TRUE(sp.prefix_cache);
  EXPECT_EQ(sp.snapshot_interval, 512);
  EXPECT_EQ(sp.host_bytes, 0);
}

TEST(Planner, LowersMaxNumSeqsToWhatStateSlotsFit) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 4 << 20;  // (4194304 - 65 x 49152) / 125952 = 7.9 slots, one of them padding
  in.max_num_seqs = 32;
  Plan p = make_plan(g, in);
  EXPECT_EQ(p.max_num_seqs, 6);
  EXPECT_EQ(p.kv_blocks, (4194304 - 7 * 125952) / 49152 - 1);  // 66: still one full-length sequence
  EXPECT_GE(p.kv_blocks, 64);
}

TEST(Planner, CapsMaxModelLenByMemoryAndKvBlocksByNeed) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 1 << 20;  // (1048576 - 2 x 125952 - 49152) / 49152 = 15 blocks -> 960 tokens
  Plan p = make_plan(g, in);
  EXPECT_EQ(p.max_model_len, 15 * 64);
  EXPECT_EQ(p.max_num_seqs, 1);  // (1048576 - 16 x 49152) / 125952 - 1 = 1.08
  EXPECT_EQ(p.kv_blocks, 15);
  // A short max_model_len with plenty of memory: blocks = max_num_seqs full sequences, not the whole budget.
  in.kv_cache_memory_bytes = 64 << 20;
  in.max_model_len = 100;
  in.max_num_seqs = 4;
  in.prefix_cache = false;
  p = make_plan(g, in);
  EXPECT_EQ(p.max_model_len, 100);
  EXPECT_EQ(p.kv_blocks, 4 * 2);
  EXPECT_EQ(p.state_slots, 4);
  // With the prefix cache, what is left gives it room of its own: as much again as the sequences take, in snapshot
  // intervals (512 tokens = 8 blocks + one slot).
  in.prefix_cache = true;
  Plan c = make_plan(g, in);
  EXPECT_GT(c.cache_slots, 0);
  EXPECT_EQ(c.cache_blocks, 8 * c.cache_slots);
  EXPECT_EQ(c.kv_blocks, 8 + c.cache_blocks);
  EXPECT_EQ(c.state_slots, 4 + c.cache_slots);
  const int64_t sequences = p.pool_bytes(4, 8) - p.pool_bytes(0, 0);
  EXPECT_LE(c.pool_bytes(c.state_slots, c.kv_blocks) - p.pool_bytes(4, 8), sequences);
  EXPECT_LE(c.pool_bytes(c.state_slots, c.kv_blocks), in.kv_cache_memory_bytes);
}

TEST(Planner, ClearErrors) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 100000;  // less than one state slot + one block
  EXPECT_NE(error_of([&] { make_plan(g, in); }).find("planner: one sequence of"), std::string::npos)
      << error_of([&] { make_plan(g, in); });
  in.kv_cache_memory_bytes = 1 << 20;
  in.max_model_len = 4096;  // 64 blocks = 3 MiB > 1 MiB
  EXPECT_NE(error_of([&] { make_plan(g, in); }).find("one sequence of 4096 tokens needs"), std::string::npos);
  in.max_model_len = 5000;
  EXPECT_NE(error_of([&] { make_plan(g, in); }).find("--max-model-len 5000 exceeds the model's context"),
            std::string::npos);
  in.max_model_len = 0;
  in.gpu_memory_utilization = 1.5;
  EXPECT_NE(error_of([&] { make_plan(g, in); }).find("--gpu-memory-utilization 1.5"), std::string::npos);
  in.gpu_memory_utilization = 0.9;
  in.device = "tpu";
  EXPECT_NE(error_of([&] { make_plan(g, in); }).find("--device 'tpu'"), std::string::npos);
}

// DeepSeek-V3's KV geometry (61 MLA layers, no KDA) with 10 GiB of weights on this rank.
ModelGeometry deepseek_geometry() {
  ModelGeometry g;
  g.arch = "deepseek_v3";
  g.state.n_mla_layers = 61;
  g.state.kv_lora_rank = 512;
  g.state.rope_dim = 64;
  g.max_position_embeddings = 163840;
  g.weight_bytes = int64_t{10} << 30;
  return g;
}

// A cuda plan at half the free memory.
PlannerInput half_of_cuda() {
  PlannerInput in;
  in.device = "cuda";
  in.gpu_memory_utilization = 0.5;
  return in;
}

TEST(Planner, CudaBudgetIsAFractionOfFreeMemoryMinusWeights) {
  ModelGeometry g = deepseek_geometry();
  PlannerInput in = half_of_cuda();
  const MemoryProbe probe = [](const std::string& device) {
    EXPECT_EQ(device, "cuda");
    return DeviceMemory{int64_t{80} << 30, int64_t{141} << 30};
  };
  Plan p = make_plan(g, in, probe);
  EXPECT_EQ(p.budget_bytes, int64_t{30} << 30);  // 0.5 x 80 GiB - 10 GiB
  in.ranks_per_device = 4;                          // ll ranks sharing the GPU: a quarter of 141 GiB at most
  EXPECT_EQ(make_plan(g, in, probe).budget_bytes, (int64_t{141} << 30) / 4 / 2 - (int64_t{10} << 30));
  in.ranks_per_device = 1;
  EXPECT_EQ(p.act_bytes, 2);
  EXPECT_EQ(p.kv_bytes_per_token, 61 * 576 * 2);  // 70272 B: bf16 latents
  EXPECT_EQ(p.state_bytes_per_seq, 0);            // no KDA layers: no state slots
  EXPECT_EQ(p.state_slots, 0);
  EXPECT_EQ(p.max_num_seqs, 256);
  EXPECT_EQ(p.max_model_len, 163840);  // 30 GiB / 70272 B = 458k tokens
  EXPECT_EQ(p.kv_blocks, (int64_t{30} << 30) / (64 * 70272) - 1);
  g.weight_bytes = int64_t{50} << 30;  // more than 0.5 x 80 GiB
  EXPECT_NE(error_of([&] { make_plan(g, in, probe); }).find("leave nothing"), std::string::npos);
}

// The worker's profile step measures what the largest step needs beyond the weights and the pools; the budget keeps
// it out (cuda only: the CPU's pools have a budget of their own, and an explicit KV budget is taken as given).
TEST(Planner, TheActivationReserveComesOutOfTheCudaBudget) {
  ModelGeometry g = deepseek_geometry();
  PlannerInput in = half_of_cuda();
  const MemoryProbe probe = [](const std::string&) { return DeviceMemory{int64_t{80} << 30, int64_t{141} << 30}; };
  in.activation_reserve_bytes = int64_t{6} << 30;
  const Plan p = make_plan(g, in, probe);
  EXPECT_EQ(p.budget_bytes, int64_t{24} << 30);  // 0.5 x 80 GiB - 10 GiB - 6 GiB
  EXPECT_EQ(p.activation_reserve_bytes, int64_t{6} << 30);
  EXPECT_EQ(p.kv_blocks, (int64_t{24} << 30) / (64 * 70272) - 1);
  EXPECT_NE(p.describe().find("step activations 6.000 GiB"), std::string::npos) << p.describe();
  in.activation_reserve_bytes = int64_t{30} << 30;  // with the weights, all of 0.5 x 80 GiB
  const std::string e = error_of([&] { make_plan(g, in, probe); });
  EXPECT_NE(e.find("largest step's activations (30.00 GiB)"), std::string::npos) << e;
  EXPECT_NE(e.find("--idle-prefill-size"), std::string::npos) << e;
  in.activation_reserve_bytes = -1;
  EXPECT_NE(error_of([&] { make_plan(g, in, probe); }).find("negative activation reserve"), std::string::npos);
  in.activation_reserve_bytes = int64_t{6} << 30;
  in.kv_cache_memory_bytes = int64_t{2} << 30;  // an explicit budget is exact
  EXPECT_EQ(make_plan(g, in, probe).budget_bytes, int64_t{2} << 30);
  EXPECT_EQ(make_plan(g, in, probe).activation_reserve_bytes, 0);
}

TEST(Planner, CpuDefaultBudgetIsCappedByRam) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  const MemoryProbe small = [](const std::string&) { return DeviceMemory{1 << 30, int64_t{4} << 30}; };
  EXPECT_EQ(make_plan(g, in, small).budget_bytes, int64_t{1} << 30);  // RAM / 4
  const MemoryProbe big = [](const std::string&) { return DeviceMemory{int64_t{64} << 30, int64_t{256} << 30}; };
  EXPECT_EQ(make_plan(g, in, big).budget_bytes, int64_t{2} << 30);  // the fixed cap
}

TEST(Planner, HostTierAndSnapshotInterval) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 10 << 20;
  in.kv_block_size = 48;
  Plan p = make_plan(g, in);
  EXPECT_EQ(p.snapshot_interval, 576);  // 512 rounded up to a multiple of lcm(48, 64) = 192
  in.snapshot_interval = 100;
  EXPECT_NE(error_of([&] { make_plan(g, in); }).find("--prefix-snapshot-interval 100 must be a multiple of 192"),
            std::string::npos) << error_of([&] { make_plan(g, in); });
  in.snapshot_interval = 0;
  in.host_memory_bytes = int64_t{3} << 30;
  const MemoryProbe ram = [](const std::string& device) {
    EXPECT_EQ(device, "cpu");
    return DeviceMemory{int64_t{2} << 30, int64_t{4} << 30};
  };
  p = make_plan(g, in, ram);
  EXPECT_EQ(p.state_plan().host_bytes, int64_t{3} << 30);
  in.host_memory_bytes = int64_t{4} << 30;  // + the 10 MiB KV budget > 4 GiB of RAM
  EXPECT_NE(error_of([&] { make_plan(g, in, ram); }).find("--host-memory-gb 4.00 does not fit"), std::string::npos)
      << error_of([&] { make_plan(g, in, ram); });
}

// --deterministic travels with the plan: the model loads batch-invariant kernels, and prefix hits resume only at
// snapshot boundaries (where the uncached prefill also cut); without it a hit resumes at any token.
TEST(Planner, DeterministicReachesTheLoadOptionsAndTheStatePlan) {
  TempDir tmp;
  ModelGeometry g = tiny_k3_geometry(tmp);
  PlannerInput in;
  in.kv_cache_memory_bytes = 10 << 20;
  Plan p = make_plan(g, in);
  EXPECT_FALSE(p.load_options().deterministic);
  EXPECT_EQ(p.state_plan().resume_align_tokens, 1);
  in.deterministic = true;
  p = make_plan(g, in);
  EXPECT_TRUE(p.load_options().deterministic);
  EXPECT_EQ(p.state_plan().resume_align_tokens, p.snapshot_interval);
  EXPECT_EQ(p.snapshot_interval, 512);
}

TEST(Planner, PlanMatchesThePoolsTheModelAllocates) {
  TempDir tmp;
  write_random_checkpoint(tiny_k3(tmp / "model"));
  ModelGeometry g = read_model_geometry(tmp / "model");
  EXPECT_GT(g.weight_bytes, 0);
  PlannerInput in;
  in.kv_cache_memory_bytes = 4 << 20;
  in.max_model_len = 256;
  in.max_num_seqs = 3;
  Plan p = make_plan(g, in);
  auto model = load_model(tmp / "model", p.load_options());
  EXPECT_EQ(model->state_geometry(), g.state);  // one derivation for the planner and the model
  kv::StateManager state(model->backend(), model->state_geometry(), p.state_plan());
  const kv::StateUsage m = state.usage();
  EXPECT_EQ(m.kv_blocks_total, p.kv_blocks);
  EXPECT_EQ(m.state_slots_total, p.state_slots);
  // The planner counts one padding block and slot per pool; a pool without padding allocates one unit less.
  const int64_t block_bytes = p.kv_block_size * p.kv_bytes_per_token;
  EXPECT_TRUE(m.kv_bytes == p.kv_bytes() || m.kv_bytes == p.kv_bytes() - block_bytes) << m.kv_bytes;
  EXPECT_TRUE(m.state_bytes == p.state_bytes() || m.state_bytes == p.state_bytes() - p.state_bytes_per_seq)
      << m.state_bytes;
}

}  // namespace
}  // namespace bg::sched

namespace bg::sched {
namespace {

// --resident-experts: the planner counts the resident experts plus two layers' worth of pool buffers, so a model
// whose experts do not fit can still be planned; at 1 the weights are the files, as without the flag.
TEST(Planner, StreamedExpertsCountTheResidentOnesAndThePool) {
  TempDir tmp;
  write_random_checkpoint(tiny_k3(tmp / "model"));
  const ModelGeometry all = read_model_geometry(tmp / "model");
  const ModelGeometry same = read_model_geometry(tmp / "model", {}, 1.0);
  EXPECT_EQ(same.weight_bytes, all.weight_bytes);
  const ModelGeometry half = read_model_geometry(tmp / "model", {}, 0.5);
  const ModelGeometry none = read_model_geometry(tmp / "model", {}, 0.0);
  const RankWeightBytes w = rank_weight_bytes(tmp / "model", {});
  ASSERT_GT(w.n_expert_blocks, 0);
  ASSERT_GT(w.n_local_experts, 1);
  const int64_t per_expert = w.experts / w.n_expert_blocks, n_layers = w.n_expert_blocks / w.n_local_experts;
  const int64_t n_res = (w.n_local_experts + 1) / 2;  // round(0.5 n)
  EXPECT_EQ(half.weight_share.experts, per_expert * (n_layers * n_res + 2 * (w.n_local_experts - n_res)));
  EXPECT_EQ(none.weight_share.experts, per_expert * 2 * w.n_local_experts);
  EXPECT_LT(none.weight_bytes, half.weight_bytes);
  EXPECT_LT(half.weight_bytes, all.weight_bytes);
  EXPECT_EQ(all.weight_bytes - half.weight_bytes, w.experts - half.weight_share.experts);
  // On CUDA each pool buffer counts twice (the copy target and the MXFP4 expert's W4A16 block).
  const ModelGeometry cuda_half = read_model_geometry(tmp / "model", {}, 0.5, 2);
  EXPECT_EQ(cuda_half.weight_share.experts, per_expert * (n_layers * n_res + 4 * (w.n_local_experts - n_res)));
  EXPECT_TRUE(w.experts_mxfp4);
  // FP8 experts have no second part: the pool counts once whatever the backend.
  const std::filesystem::path fp8 = bg::testing::golden_dir() / "deepseek_v3/tiny-fp8/model";
  const RankWeightBytes f = rank_weight_bytes(fp8, {});
  EXPECT_FALSE(f.experts_mxfp4);
  const int64_t f_per = f.experts / f.n_expert_blocks, f_layers = f.n_expert_blocks / f.n_local_experts;
  const int64_t f_res = (f.n_local_experts + 1) / 2;
  EXPECT_EQ(read_model_geometry(fp8, {}, 0.5, 2).weight_share.experts,
            f_per * (f_layers * f_res + 2 * (f.n_local_experts - f_res)));
}

}  // namespace
}  // namespace bg::sched

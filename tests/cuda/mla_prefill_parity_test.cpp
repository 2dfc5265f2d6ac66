// The non-absorbed MLA prefill path (mla_prefill_cuda.h) against the CPU reference, with the absorbed kernel on the
// other tokens of the step as the CUDA backend runs it: fresh prompts, prefix + chunk, ragged mixed steps, contexts
// cut into several passes (state carried in fp32), cuDNN plans and their buckets, the production dims and the padded
// small ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda/mla_testing.h"
#include "cuda_testing.h"
#include "ops/mla/mla.h"
#include "ops/mla/mla_cuda.h"
#include "ops/linear/linear_cuda.h"
#include "ops/mla/mla_decode_cuda.h"
#include "ops/mla/mla_prefill_cuda.h"

namespace bg::ops {
namespace {

using namespace mla_testing;  // NOLINT: the shared MLA test helpers

// ---- prefill path (mla_prefill_cuda.h) -----------------------------------------------------------------------------

// One step: per sequence, the last n_query[s] of its written positions are the step's query tokens (in sequence
// order, as the scheduler lays a step out). Sequences with at least options.min_tokens queries take the prefill path,
// the others the absorbed kernel over their token ranges; every token is checked against the CPU reference.
// With kCudnn at the production dims, every cuDNN call of the plan must have run, or none with expect_cudnn false
// (a plan still building in the background; `shared` keeps plans across calls when given).
void run_prefill_with(PagedSequences& seqs, const std::vector<int64_t>& n_query, int64_t n_heads,
                      const MlaPrefillOptions& options, uint64_t seed, bool expect_state, MlaPrefillMma mma,
                      MlaCudnnPrefill* shared = nullptr, bool expect_cudnn = true) {
  const Dims& d = seqs.dims;
  const int64_t lora = d.lora, nope = d.nope, v_head = d.v, block = d.block;
  const int64_t nh = n_heads, qk = d.nope + d.rope;
  std::vector<int32_t> seq_idx;
  std::vector<int64_t> positions, seq_begin{0};
  for (size_t s = 0; s < n_query.size(); ++s) {
    for (int64_t p = seqs.lengths[s] - n_query[s]; p < seqs.lengths[s]; ++p) {
      seq_idx.push_back(static_cast<int32_t>(s));
      positions.push_back(p);
    }
    seq_begin.push_back(static_cast<int64_t>(positions.size()));
  }
  const auto n = static_cast<int64_t>(positions.size());
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(lora));
  std::vector<float> q = random_floats(static_cast<size_t>(n * nh * qk), 1.0f, seed);
  std::vector<float> w_uk = random_floats(static_cast<size_t>(nh * nope * lora), w_scale, seed + 1);
  std::vector<float> w_uv = random_floats(static_cast<size_t>(nh * v_head * lora), w_scale, seed + 2);
  DeviceBuffer d_q = cuda::upload(to_bf16(q)), d_uk = cuda::upload(to_bf16(w_uk)), d_uv = cuda::upload(to_bf16(w_uv));
  DeviceBuffer d_seq = cuda::upload(seq_idx), d_pos = cuda::upload(positions);
  DeviceBuffer d_out(static_cast<size_t>(n * nh * v_head) * 2);
  d_out.fill_bytes(0xff);
  const float scale = 1.0f / std::sqrt(static_cast<float>(qk));
  const MlaParams p{n, nh, lora, nope, d.rope, v_head, block, scale};

  const MlaPrefillPlan plan = mla_prefill_plan(positions, seq_begin, options);
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(plan.needs_state, expect_state);
  const MlaPrefillWorkspace ws = mla_prefill_workspace(p, plan);
  DeviceBuffer d_ws(ws.total_bytes);
  d_ws.fill_bytes(0xff);  // poisoned: every region the launch reads it writes first (but the metadata)
  const std::vector<std::byte> meta = mla_prefill_meta(plan, ws);
  BG_CUDA_CHECK(cudaMemcpy(d_ws.data(), meta.data(), meta.size(), cudaMemcpyHostToDevice));
  cublasHandle_t handle = nullptr;
  BG_CUBLAS_CHECK(cublasCreate(&handle));
  DeviceBuffer cublas_ws(kCublasWorkspaceBytes);
  DeviceBuffer d_flags = cuda::upload(std::vector<int32_t>{0});
  MlaPagedCache cache = seqs.cache_view(d_seq, d_pos);
  cache.error_flags = d_flags.as<int32_t>();
  MlaCudnnPrefill own_cudnn;
  MlaCudnnPrefill& cudnn = shared != nullptr ? *shared : own_cudnn;
  const int64_t launches_before = cudnn.launches();
  const MlaPrefillContext ctx{{handle, cublas_ws.data(), kCublasWorkspaceBytes, d_ws.data(), ws.total_bytes}, &cudnn};
  mla_prefill_cuda(p, plan, ws, d_q.as<__nv_bfloat16>(), d_uk.as<__nv_bfloat16>(), d_uv.as<__nv_bfloat16>(), cache,
                   d_out.as<__nv_bfloat16>(), ctx, nullptr, mma);
  // The other tokens as the backend runs them: runs of single-token sequences through the decode kernel at the
  // production latent shape, anything else through the general kernel.
  int n_sms = 0;
  BG_CUDA_CHECK(cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, 0));
  for (const auto& [b, e] : plan.absorbed_runs) {
    MlaParams run = p;
    run.n_tokens = e - b;
    MlaPagedCache pc = cache;
    pc.seq_idx += b;
    pc.positions += b;
    const MlaDecodeTensors t{d_q.as<__nv_bfloat16>() + b * nh * qk, d_uk.as<__nv_bfloat16>(),
                             d_uv.as<__nv_bfloat16>(), d_out.as<__nv_bfloat16>() + b * nh * v_head};
    if (plan.absorbed_single_tokens && mla_decode_takes(run)) {
      const MlaDecodePlan dplan = mla_decode_plan(run, n_sms);
      DeviceBuffer d_dws(dplan.ws.total_bytes);
      mla_decode_cuda(dplan, t, pc, {handle, cublas_ws.data(), kCublasWorkspaceBytes, d_dws.data(),
                                     dplan.ws.total_bytes}, nullptr);
      BG_CUDA_CHECK(cudaDeviceSynchronize());  // d_dws is freed at the end of this scope
    } else {
      mla_attention_cuda(run, t.q, t.w_uk, t.w_uv, pc, t.out, nullptr);
    }
  }
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  BG_CUBLAS_CHECK(cublasDestroy(handle));
  EXPECT_EQ(cuda::download<int32_t>(d_flags, 1)[0], 0);
  const std::vector<float> got = from_bf16(cuda::download<uint16_t>(d_out, static_cast<size_t>(n * nh * v_head)));
  // At the production dims every cuDNN call of the plan ran (all or nothing per step).
  int64_t cudnn_calls = 0;
  if (mma == MlaPrefillMma::kCudnn && nope == kMlaPrefillNope && d.rope == kMlaPrefillRope && v_head == kMlaPrefillV &&
      expect_cudnn) {
    cudnn_calls = static_cast<int64_t>(plan.cudnn_calls.size());
    EXPECT_GT(cudnn_calls, 0);
  }
  EXPECT_EQ(cudnn.launches() - launches_before, cudnn_calls) << cudnn.last_refusal();

  const size_t row = static_cast<size_t>(nh * v_head);
  double worst = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t s = seq_idx[static_cast<size_t>(t)];
    const std::vector<float> ref =
        seqs.reference(p, q.data() + t * nh * qk, w_uk.data(), w_uv.data(), s, positions[static_cast<size_t>(t)]);
    const std::vector<float> got_row(got.begin() + static_cast<std::ptrdiff_t>(t * row),
                                     got.begin() + static_cast<std::ptrdiff_t>((t + 1) * row));
    const double err = testing::max_rel_error(got_row, ref);
    worst = std::max(worst, err);
    ASSERT_LE(err, testing::kTolBf16Out) << mla_prefill_mma_name(mma) << " token " << t << " seq " << s << " pos "
                                         << positions[size_t(t)]
                                         << " lora/rope/nope/v " << lora << "/" << d.rope << "/" << nope << "/"
                                         << v_head;
  }
  std::printf("[mla prefill %s] lora %lld rope %lld nope %lld v %lld block %lld, heads %lld, %lld tokens, %zu "
              "passes (%lld cuDNN calls), %zu items: max rel err %.3g\n",
              mla_prefill_mma_name(mma), static_cast<long long>(lora), static_cast<long long>(d.rope),
              static_cast<long long>(nope),
              static_cast<long long>(v_head), static_cast<long long>(block), static_cast<long long>(nh),
              static_cast<long long>(n), plan.passes.size(), static_cast<long long>(cudnn_calls), plan.items.size(),
              worst);
}

// Both tensor-core kernels on the same step.
void run_prefill(PagedSequences& seqs, const std::vector<int64_t>& n_query, int64_t n_heads,
                 const MlaPrefillOptions& options, uint64_t seed, bool expect_state) {
  for (MlaPrefillMma mma : {MlaPrefillMma::kWgmma, MlaPrefillMma::kMmaSync, MlaPrefillMma::kCudnn}) {
    if (mma == MlaPrefillMma::kCudnn && !MlaCudnnPrefill::built()) continue;
    run_prefill_with(seqs, n_query, n_heads, options, seed, expect_state, mma);
  }
}

TEST(MlaPrefillCudnn, K3HeadsAndBucketsShareOnePlan) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // K3's 96 heads. Fresh prompts of 300 and 400 tokens fall in one bucket (512 queries, 512 keys): one plan, two
  // launches; a 200-token chunk after a 1000-token prefix (bottom-right causal) takes a second plan.
  MlaCudnnPrefill cudnn;
  PagedSequences a({300}, 940), b({400}, 941), c({1200}, 942);
  a.write_all(943);
  b.write_all(944);
  c.write_all(945);
  run_prefill_with(a, {300}, 96, {}, 946, false, MlaPrefillMma::kCudnn, &cudnn);
  run_prefill_with(b, {400}, 96, {}, 947, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 1);
  const double first_ms = cudnn.plan_build_ms();
  run_prefill_with(c, {200}, 96, {}, 948, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 2);
  EXPECT_EQ(cudnn.launches(), 3);
  std::printf("[mla prefill cudnn] plan build: the process's first %.1f ms, the next %.1f ms\n", first_ms,
              cudnn.plan_build_ms() - first_ms);
}

TEST(MlaPrefillCudnn, BatchesRoundUpToAPowerOfTwoWithEmptySequences) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // Three fresh prompts launch with batch 4 (the fourth sequence empty), four with batch 4: one plan for both, and
  // every token equal to the CPU reference (the empty entry writes nothing).
  MlaCudnnPrefill cudnn;
  PagedSequences three({100, 300, 200}, 960), four({400, 50, 130, 7}, 961);
  three.write_all(962);
  four.write_all(963);
  run_prefill_with(three, {100, 300, 200}, 96, {}, 964, false, MlaPrefillMma::kCudnn, &cudnn);
  run_prefill_with(four, {400, 50, 130, 7}, 96, {}, 965, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 1);
  EXPECT_EQ(cudnn.launches(), 2);
}

TEST(MlaPrefillCudnn, BackgroundBuildsLetTheStepRunOnTheKernel) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  MlaCudnnPrefill cudnn;
  cudnn.set_background_builds(true);
  PagedSequences a({300, 120}, 970);
  a.write_all(971);
  {
    // While builds are held (a graph capture), the queued plan is not built; the step runs batchgen's own kernel.
    const std::unique_lock held = cudnn.hold_builds();
    run_prefill_with(a, {300, 120}, 96, {}, 972, false, MlaPrefillMma::kCudnn, &cudnn, false);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(cudnn.plans_built(), 0);
    EXPECT_EQ(cudnn.launches(), 0);
  }
  size_t free_before = 0, free_after = 0, total = 0;
  BG_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  cudnn.wait_for_builds();
  BG_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(cudnn.plans_built(), 1) << cudnn.last_refusal();
  std::printf("[mla prefill cudnn] a plan built on the helper thread (its own handle) in %.1f ms took %.1f MiB of "
              "device memory\n", cudnn.plan_build_ms(),
              (static_cast<double>(free_before) - static_cast<double>(free_after)) / (1 << 20));
  // Built on the helper thread with a handle of its own, run from this one.
  run_prefill_with(a, {300, 120}, 96, {}, 973, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.launches(), 1);
  // A second bucket while the first is in use.
  PagedSequences b({1500}, 974);
  b.write_all(975);
  run_prefill_with(b, {1500}, 96, {}, 976, false, MlaPrefillMma::kCudnn, &cudnn, false);
  cudnn.wait_for_builds();
  run_prefill_with(b, {1500}, 96, {}, 977, false, MlaPrefillMma::kCudnn, &cudnn);
  run_prefill_with(a, {300, 120}, 96, {}, 978, false, MlaPrefillMma::kCudnn, &cudnn);
  EXPECT_EQ(cudnn.plans_built(), 2);
  EXPECT_EQ(cudnn.launches(), 3);
}

TEST(MlaPrefillCudnn, PlansPastTheBoundAreDroppedAndRebuilt) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // Six buckets under a bound of four: the two least recently used plans are dropped (their handles freed), every
  // step still matches the CPU reference, and a dropped bucket that comes back is rebuilt.
  MlaCudnnPrefill cudnn;
  EXPECT_THROW(cudnn.set_max_plans(MlaCudnnPrefill::kMinPlans - 1), Error);
  cudnn.set_max_plans(4);
  EXPECT_EQ(cudnn.max_plans(), 4);
  uint64_t seed = 990;
  auto step = [&](int64_t total, int64_t queries) {
    PagedSequences s({total}, seed++);
    s.write_all(seed++);
    run_prefill_with(s, {queries}, 8, {}, seed++, false, MlaPrefillMma::kCudnn, &cudnn);
  };
  for (const int64_t len : {50, 100, 200, 400, 700}) step(len, len);  // buckets 64 .. 1024 (fresh, causal)
  step(1200, 200);                                                     // q 256 after a prefix: kv 2048
  EXPECT_EQ(cudnn.plans_built(), 6) << cudnn.last_refusal();
  EXPECT_EQ(cudnn.plans_held(), 4);
  EXPECT_EQ(cudnn.plans_dropped(), 2);
  EXPECT_EQ(cudnn.launches(), 6);
  step(400, 400);  // still held: no build
  EXPECT_EQ(cudnn.plans_built(), 6);
  step(50, 50);  // dropped first: rebuilt, and another dropped for it
  EXPECT_EQ(cudnn.plans_built(), 7);
  EXPECT_EQ(cudnn.plans_held(), 4);
  EXPECT_EQ(cudnn.plans_dropped(), 3);
  cudnn.set_max_plans(MlaCudnnPrefill::kMinPlans);
  EXPECT_EQ(cudnn.launches(), 8);
}

TEST(MlaPrefillCudnn, ExactBucketsRunPlansWithoutPaddingMasks) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // Calls of one sequence that fills its buckets run exact plans (no padding mask, not ragged), each checked against
  // the CPU reference; a batch, or a length under its bucket, still takes the padded ragged plan.
  MlaCudnnPrefill cudnn;
  uint64_t seed = 1100;
  auto step = [&](std::vector<int64_t> totals, std::vector<int64_t> queries, MlaPrefillOptions options,
                  bool state) {
    PagedSequences s(std::move(totals), seed++);
    s.write_all(seed++);
    run_prefill_with(s, queries, 96, options, seed++, state, MlaPrefillMma::kCudnn, &cudnn);
  };
  step({512}, {512}, {}, false);  // one fresh prompt: causal, row >= column
  EXPECT_EQ(cudnn.exact_launches(), 1);
  step({256, 256}, {256, 256}, {}, false);  // two: a ragged batch, padded plan
  EXPECT_EQ(cudnn.exact_launches(), 1);
  step({256}, {128}, {}, false);  // a 128-token chunk after a 128-token prefix: bottom right from the lengths
  EXPECT_EQ(cudnn.exact_launches(), 2);
  // Passes of 128 rows: a fresh 64-token prompt, and a 64-token chunk after a 64-token prefix whose full piece reads
  // K and V from gathered row 64 of its pass; three exact calls of batch 1, merged through the log-sum-exp.
  step({64, 128}, {64, 64}, {2, 128}, true);
  EXPECT_EQ(cudnn.exact_launches(), 5);
  EXPECT_EQ(cudnn.launches(), 6);
  step({500}, {500}, {}, false);  // under its bucket (512): the padded plan
  EXPECT_EQ(cudnn.exact_launches(), 5);
  EXPECT_EQ(cudnn.launches(), 7);
}

TEST(MlaPrefillCudnn, ExactPlansFromTheEnvironment) {
  EXPECT_TRUE(mla_cudnn_exact_plans(nullptr));
  EXPECT_TRUE(mla_cudnn_exact_plans("1"));
  EXPECT_TRUE(mla_cudnn_exact_plans(""));
  EXPECT_FALSE(mla_cudnn_exact_plans("0"));
  for (const char* bad : {"2", "yes", "-1"}) EXPECT_THROW(mla_cudnn_exact_plans(bad), Error) << bad;
}

TEST(MlaPrefillCudnn, MaxPlansFromTheEnvironment) {
  EXPECT_EQ(mla_cudnn_max_plans(nullptr), MlaCudnnPrefill::kDefaultMaxPlans);
  EXPECT_EQ(mla_cudnn_max_plans(""), MlaCudnnPrefill::kDefaultMaxPlans);
  EXPECT_EQ(mla_cudnn_max_plans("8"), 8);
  EXPECT_EQ(mla_cudnn_max_plans("4"), 4);
  for (const char* bad : {"3", "0", "-8", "8x", "x", " 8", "99999999999999999999"}) {
    EXPECT_THROW(mla_cudnn_max_plans(bad), Error) << bad;
  }
}

TEST(MlaPrefillCudnn, K3PassesMergeThroughTheLogSumExp) {
  BG_REQUIRE_GPU();
  if (!MlaCudnnPrefill::built()) GTEST_SKIP() << "this build has no cuDNN";
  // 96 heads, passes of 512 rows: a 1300-token fresh prompt (3 passes: causal and full pieces merged) beside a 2-token
  // chunk after a 900-token prefix and a decode token.
  PagedSequences seqs({1300, 902, 40}, 950);
  seqs.write_all(951);
  run_prefill_with(seqs, {1300, 2, 1}, 96, {2, 512}, 952, true, MlaPrefillMma::kCudnn);
}

TEST(MlaPrefillCudnn, ChoiceFromTheEnvironment) {
  BG_REQUIRE_GPU();
  ::setenv("BG_MLA_PREFILL", "wgmma", 1);
  EXPECT_EQ(mla_prefill_mma_from_env(), MlaPrefillMma::kWgmma);
  ::setenv("BG_MLA_PREFILL", "mmasync", 1);
  EXPECT_EQ(mla_prefill_mma_from_env(), MlaPrefillMma::kMmaSync);
  ::setenv("BG_MLA_PREFILL", "flash", 1);
  EXPECT_THROW(mla_prefill_mma_from_env(), Error);
  ::unsetenv("BG_MLA_PREFILL");
  EXPECT_EQ(mla_prefill_mma_from_env(), MlaCudnnPrefill::built() ? MlaPrefillMma::kCudnn : MlaPrefillMma::kWgmma);
}

TEST(MlaPrefillCuda, FreshPromptMatchesCpu) {
  BG_REQUIRE_GPU();
  PagedSequences seqs({300}, 900);
  seqs.write_all(901);
  run_prefill(seqs, {300}, 16, {}, 902, false);
}

TEST(MlaPrefillCuda, PrefixPlusChunkAcrossPassesMatchesCpu) {
  BG_REQUIRE_GPU();
  // 300 new tokens after a 700-token prefix, the 1000-row context cut into passes of 192 rows: the softmax state of
  // every query tile crosses 5 pass boundaries.
  PagedSequences seqs({1000}, 910);
  seqs.write_all(911);
  run_prefill(seqs, {300}, 8, {64, 192}, 912, true);
  run_prefill(seqs, {300}, 8, {64, 16384}, 913, false);
}

TEST(MlaPrefillCuda, RaggedMixedStepMatchesCpu) {
  BG_REQUIRE_GPU();
  // Prefill pieces of 129, 64, 200 and 65 tokens (contexts 129, 64, 517, 1100) among decode tokens and a piece below
  // min_tokens (absorbed kernel), passes of 320 rows cutting sequences mid-context.
  PagedSequences seqs({129, 40, 64, 517, 30, 1100, 90}, 920);
  seqs.write_all(921);
  run_prefill(seqs, {129, 1, 64, 200, 1, 65, 63}, 12, {64, 320}, 922, true);
  // The backend's default: every piece of two or more tokens on the prefill path, the single tokens on the decode
  // kernel.
  run_prefill(seqs, {129, 1, 64, 200, 1, 65, 2}, 12, {}, 923, false);
}

TEST(MlaPrefillCuda, SmallAndOddDimsMatchCpu) {
  BG_REQUIRE_GPU();
  // The padded path: golden / random checkpoint dims, odd entries, rope 0, a misaligned cache.
  for (const auto& [d, heads, base_offset] : std::vector<std::tuple<Dims, int64_t, int64_t>>{
           {{32, 16, 16, 16, 16}, 4, 0},
           {{48, 8, 8, 24, 16}, 2, 0},
           {{37, 5, 7, 3, 5}, 3, 0},
           {{33, 0, 8, 8, 16}, 9, 0},
           {{100, 64, 64, 40, 32}, 10, 0},
           {{32, 16, 16, 16, 16}, 4, 1},
           {kProd, 8, 1}}) {
    PagedSequences seqs({150, 260}, 930 + heads, d, base_offset);
    seqs.write_all(931 + heads);
    run_prefill(seqs, {150, 100}, heads, {32, 128}, 932 + heads, true);
  }
}

TEST(MlaPrefillCuda, RejectsUntakenShapes) {
  BG_REQUIRE_GPU();
  MlaParams p{4, 2, 32, 16, 16, 16, 16, 0.1f};
  EXPECT_TRUE(mla_prefill_takes(p));
  p.qk_nope_dim = 129;
  EXPECT_FALSE(mla_prefill_takes(p));
  EXPECT_THROW(mla_prefill_workspace(p, {}), Error);
  p.qk_nope_dim = 16;
  p.qk_rope_dim = 65;
  EXPECT_FALSE(mla_prefill_takes(p));
  p.qk_rope_dim = 16;
  p.v_head_dim = 130;
  EXPECT_FALSE(mla_prefill_takes(p));
}

}  // namespace
}  // namespace bg::ops

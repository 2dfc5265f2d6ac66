// The dequantize-once grouped prefill path of the expert FFN (ops/moe/moe_grouped_cuda.h) against the CPU reference
// of the whole routed path (gather -> linear_cpu gate/up -> SwiGLU/SiTU -> linear_cpu down -> weighted combine), on
// random inputs: Kimi-K3 latent (3584 <-> 3072, SiTU) and DeepSeek-V3 (7168 <-> 2048, SwiGLU) expert widths with
// 32..400 rows per expert, MXFP4 first and FP8 / bf16 experts, ragged widths, routings that leave experts empty, and
// groups smaller than the touched experts (the scratch reused); MXFP4 experts also from the W4A16 layout (the same bits
// as from the checkpoint's format). Same tolerance as the other MoE parity tests (1e-2 of max |ref|, bf16 outputs).
// Every device buffer starts poisoned (0xff: bf16 NaN), so a row that is not written fails.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "cuda/moe_testing.h"
#include "ops/moe/moe_grouped_cuda.h"

namespace bg::ops {
namespace {

using namespace moe_testing;  // NOLINT: the shared MoE test helpers

struct GroupedCase {
  const char* name;
  ExpertShape shape;
  int64_t top_k, n_used;
  MoeGlu act;
  std::vector<int64_t> token_counts;
  int64_t group_experts = kMoeGroupedMaxGroupExperts;
};

// The grouped path's buffers for one plan, poisoned.
struct GroupedBuffers {
  cuda::DeviceBuffer weights, gu, pointers;
  MoeGroupedBuffers view;
  GroupedBuffers(const MoeGroupedPlan& plan)
      : weights(static_cast<size_t>(plan.group_experts) * moe_grouped_expert_bytes(plan.hidden, plan.inter)),
        gu(std::max<size_t>(1, moe_grouped_gu_bytes(plan))),
        pointers(std::max<size_t>(1, moe_grouped_pointer_bytes(plan))) {
    weights.fill_bytes(0xff);
    gu.fill_bytes(0xff);
    pointers.fill_bytes(0xff);
    view = {weights.as<__nv_bfloat16>(), weights.bytes(), gu.as<__nv_bfloat16>(), gu.bytes(), pointers.as<void*>(),
            pointers.bytes()};
  }
};

void run_grouped_case(const GroupedCase& c, uint64_t seed) {
  const Experts ex = make_experts(c.shape, seed);
  // MXFP4 experts the W4A16 layout takes also run from it (a packed layer's only device copy): the same bits.
  std::optional<MoeW4a16DeviceLayer> packed;
  if (c.shape.format == WeightFormat::kMxfp4 && c.shape.hidden % 32 == 0 && c.shape.inter % 32 == 0) {
    std::vector<MoeW4a16ExpertView> views;
    for (size_t e = 0; e < ex.gate.size(); ++e) views.push_back({&ex.gate[e].w, &ex.up[e].w, &ex.down[e].w});
    packed = moe_w4a16_upload(views, c.shape.hidden, c.shape.inter);
  }
  testing::CublasFixture blas;
  const int64_t E = c.shape.n_experts, hidden = c.shape.hidden;
  for (int64_t n : c.token_counts) {
    const std::string what = fmt::format("{}: {} n={} rows/expert~{} group={}", c.name,
                                         weight_format_name(c.shape.format), n, n * c.top_k / c.n_used,
                                         c.group_experts);
    MoeCudaParams p = params(n, c.top_k, E, E, hidden, c.shape.inter);
    p.expert_format = c.shape.format;
    p.act = {c.act, 4.0f, 25.0f};
    const Routing r = random_routing(n, c.top_k, c.n_used, seed + static_cast<uint64_t>(n));
    std::vector<float> x;
    const std::vector<uint16_t> x_bits =
        testing::random_bf16(static_cast<size_t>(n * hidden), 1.0f, seed * 7 + static_cast<uint64_t>(n), &x);
    Workspace w(p, slot_map_every(E, 1));
    cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights), d_x = cuda::upload(x_bits);
    cuda::DeviceBuffer d_out(static_cast<size_t>(std::max<int64_t>(1, n * hidden)) * 2);
    d_out.fill_bytes(0xff);
    moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
    moe_gather_cuda(p, d_x.as<__nv_bfloat16>(), w.ws, nullptr);
    const MoeGroupedPlan plan = moe_grouped_plan_from_device(p, w.ws, c.group_experts, nullptr);
    // The plan is the CPU dispatch's: same touched slots, rows and offsets.
    const HostRouting ref(p.shape, slot_map_every(E, 1), r);
    ASSERT_EQ(plan.n_active(), *ref.r.n_active) << what;
    for (size_t i = 0; i < plan.slots.size(); ++i) {
      const int32_t s = plan.slots[i];
      ASSERT_EQ(s, ref.r.active[i]) << what;
      ASSERT_EQ(plan.rows[i], ref.r.counts[s]) << what;
      ASSERT_EQ(plan.row_begin[i], ref.r.offsets[s]) << what;
    }
    const std::vector<float> want = reference_moe(p, ex, r, x);
    // Both GEMM entry points, each from freshly poisoned outputs and scratch; then the packed layout's copy.
    std::vector<uint16_t> first_bits;
    for (int run = 0; run < (packed ? 3 : 2); ++run) {
      const MoeGroupedGemmApi api = run == 1 ? MoeGroupedGemmApi::kPerExpert : MoeGroupedGemmApi::kGrouped;
      const std::string label = what + (run == 2 ? " w4a16 layout" : run == 0 ? " grouped" : " per-expert");
      for (cuda::DeviceBuffer* b : {&w.h, &w.y_perm, &d_out}) b->fill_bytes(0xff);
      GroupedBuffers bufs(plan);
      MoeGroupedArgs a;
      a.plan = &plan;
      a.experts = run == 2 ? nullptr : ex.table.as<ExpertWeightsCuda>();
      a.packed = run == 2 ? &packed->weights : nullptr;
      a.ws = w.ws;
      a.bufs = bufs.view;
      a.ctx = {blas.handle, blas.workspace.data(), blas.workspace.bytes(), api};
      moe_grouped_write_pointers(a, nullptr);
      moe_expert_ffn_grouped_cuda(p, a, nullptr);
      moe_combine_cuda(p, w.ws, d_out.data(), nullptr);
      BG_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(w.error_word(), 0) << label;
      const std::vector<uint16_t> bits = cuda::download<uint16_t>(d_out, static_cast<size_t>(n * hidden));
      testing::expect_parity(testing::from_bf16(bits), want, testing::kTolBf16Out, label);
      if (run == 0) first_bits = bits;
      if (run == 2) {
        EXPECT_TRUE(bits == first_bits) << label << ": dequantized from the layout, not the same bits";
      }
    }
  }
}

TEST(MoeGroupedParity, GemmApiFromEnvironment) {
  EXPECT_EQ(moe_grouped_gemm_api(nullptr), MoeGroupedGemmApi::kPerExpert);
  EXPECT_EQ(moe_grouped_gemm_api("grouped"), MoeGroupedGemmApi::kGrouped);
  EXPECT_EQ(moe_grouped_gemm_api("per_expert"), MoeGroupedGemmApi::kPerExpert);
  EXPECT_THROW(moe_grouped_gemm_api("loop"), Error);
}

TEST(MoeGroupedParity, KimiK3LatentExperts) {
  BG_REQUIRE_GPU();
  // 10 experts, 8 ever chosen (2 empty), top-4: 48 and 100 rows per expert; groups of 3 (scratch reused 3 times).
  run_grouped_case({"kimi-k3", {10, 3584, 3072, WeightFormat::kMxfp4}, 4, 8, MoeGlu::kSitu, {96, 200}, 3}, 101);
}

TEST(MoeGroupedParity, DeepSeekV3Experts) {
  BG_REQUIRE_GPU();
  // 8 experts, 6 chosen, top-2: 33 (about the default threshold) and 80 rows per expert; one group.
  run_grouped_case({"deepseek-v3", {8, 7168, 2048, WeightFormat::kMxfp4}, 2, 6, MoeGlu::kSwiGlu, {100, 240}}, 102);
}

TEST(MoeGroupedParity, ManyRowsAllFormats) {
  BG_REQUIRE_GPU();
  // 64 experts, 40 chosen, top-8: 40 and 400 rows per expert; groups of 16 and of 64.
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kFp8Block, WeightFormat::kDense}) {
    run_grouped_case({"small situ", {64, 256, 128, f}, 8, 40, MoeGlu::kSitu, {200, 2000}, 16}, 103);
    run_grouped_case({"small swiglu", {64, 256, 128, f}, 8, 40, MoeGlu::kSwiGlu, {2000}}, 104);
  }
}

TEST(MoeGroupedParity, RaggedWidthsAndEdges) {
  BG_REQUIRE_GPU();
  // hidden 200 / inter 130: the dequant and GLU kernels' scalar paths (widths not multiples of 8).
  for (WeightFormat f : {WeightFormat::kFp8Block, WeightFormat::kDense}) {
    run_grouped_case({"ragged", {16, 200, 130, f}, 4, 16, MoeGlu::kSwiGlu, {100, 700}, 5}, 105);
  }
  // No tokens (an empty plan: nothing runs), one token (every touched expert has one row), one expert touched.
  run_grouped_case({"edges", {16, 256, 128, WeightFormat::kMxfp4}, 4, 16, MoeGlu::kSitu, {0, 1}, 2}, 106);
  run_grouped_case({"one expert", {16, 256, 128, WeightFormat::kMxfp4}, 1, 1, MoeGlu::kSitu, {300}, 2}, 107);
}

TEST(MoeGroupedParity, BadDescriptorRaisesErrorFlag) {
  BG_REQUIRE_GPU();
  // The table says [128 x 256] but the launch is for [64 x 256]: the dequant must not read it with the wrong stride.
  const Experts ex = make_experts({4, 256, 128, WeightFormat::kMxfp4}, 108);
  testing::CublasFixture blas;
  MoeCudaParams p = params(64, 2, 4, 4, 256, 64);
  p.expert_format = WeightFormat::kMxfp4;
  const Routing r = random_routing(64, 2, 4, 109);
  Workspace w(p, slot_map_every(4, 1));
  cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights);
  moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
  const MoeGroupedPlan plan = moe_grouped_plan_from_device(p, w.ws, 4, nullptr);
  GroupedBuffers bufs(plan);
  MoeGroupedArgs a;
  a.plan = &plan;
  a.experts = ex.table.as<ExpertWeightsCuda>();
  a.ws = w.ws;
  a.bufs = bufs.view;
  a.ctx = {blas.handle, blas.workspace.data(), blas.workspace.bytes()};
  moe_grouped_dequant_cuda(p, a, 0, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());  // no trap: the context stays usable
  EXPECT_EQ(w.error_word(), kMoeErrorBadDescriptor);
  // Buffers too small for the plan are refused on the host.
  a.bufs.weight_bytes = moe_grouped_expert_bytes(256, 64) - 2;
  EXPECT_THROW(moe_expert_ffn_grouped_cuda(p, a, nullptr), Error);
}

}  // namespace
}  // namespace bg::ops

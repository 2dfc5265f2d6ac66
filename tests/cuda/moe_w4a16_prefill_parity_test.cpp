// The W4A16 MXFP4 prefill kernel (moe_w4a16_prefill_cuda, rows in, rows out) against the CPU reference run over the
// gathered rows: every tile size and edge, Kimi-K3 and DeepSeek-V3 shapes, a slot without a block, reruns, the fused
// gather and graph replays bit for bit, bad input.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "cuda/moe_w4a16_testing.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_prefill_cuda.h"

namespace bg::ops {
namespace {

using namespace w4a16_testing;  // NOLINT: the shared W4A16 test helpers

// The dispatch's gathered rows through the prefill kernel: y against each row's expert output (rows_reference), the
// error word clean; then bitwise: an eager rerun, the tokens gathered by the kernel itself (MoeW4a16PrefillIo::gather)
// and two graph replays of that, each from a poisoned y. `null_slot` >= 0: that
// slot's block pointer is null: flagged, and the other slots' rows still right.
void check_prefill(const char* name, const ExpertSet& set, int64_t hidden, int64_t inter, int64_t top_k,
                   MoeW4a16Act act, const RunSpec& spec, uint64_t seed, int null_slot = -1) {
  const int64_t E = static_cast<int64_t>(set.views.size());
  const std::string what = fmt::format("prefill {} n={} {} used={}{}", name, spec.n_tokens,
                                       spec.pattern == Pattern::kSame ? "same-experts" : "random", spec.n_used,
                                       null_slot >= 0 ? " (a slot without a block)" : "");
  const Routing r = make_routing(spec.n_tokens, top_k, E, spec.n_used > 0 ? spec.n_used : E, spec.pattern, seed);
  Stream st;
  Launch L;
  prepare(L, set, hidden, inter, top_k, act, spec, r, seed, st.s);
  moe_gather_cuda(L.mp, L.d_x.as<__nv_bfloat16>(), L.dws, st.s);
  const MoeW4a16Params p = moe_w4a16_rows_params(L.mp);
  const int64_t rows = spec.n_tokens * top_k;
  MoeW4a16Weights w = set.layer.weights;
  cuda::DeviceBuffer holes;
  if (null_slot >= 0) {
    std::vector<const void*> table = set.layer.host_table;
    table[static_cast<size_t>(null_slot)] = nullptr;
    holes = cuda::upload(table);
    w.blocks = holes.as<const void*>();
  }
  cuda::DeviceBuffer ws(
      std::max(moe_w4a16_prefill_workspace_bytes(p, false), moe_w4a16_prefill_workspace_bytes(p, true)));
  cuda::DeviceBuffer h(static_cast<size_t>(std::max<int64_t>(rows * moe_w4a16_prefill_h_width(p), 1)) * 2);
  cuda::DeviceBuffer y(static_cast<size_t>(std::max<int64_t>(rows * hidden, 1)) * 2);
  ws.fill_bytes(0xff);
  h.fill_bytes(0xff);
  // gather = false: the gathered rows (x_perm) in; true: the tokens in, read through row_token by the kernel.
  const auto run = [&](cudaStream_t s, bool gather) {
    moe_w4a16_prefill_cuda(p, w, L.dws,
                           {gather ? L.d_x.as<__nv_bfloat16>() : L.dws.x_perm, gather, h.as<__nv_bfloat16>(),
                            y.as<__nv_bfloat16>(), ws.data()},
                           s);
  };
  y.fill_bytes(0xff);
  run(st.s, false);
  BG_CUDA_CHECK(cudaStreamSynchronize(st.s));
  const std::vector<uint16_t> bits = cuda::download<uint16_t>(y, static_cast<size_t>(rows * hidden));
  std::vector<float> got = testing::from_bf16(bits), ref = rows_reference(p, set, L.x, r);
  if (null_slot >= 0) {
    EXPECT_EQ(L.dispatch->error_word(), kMoeErrorBadDescriptor) << what;
    // Rows in dispatch order: the null slot's rows are those before it in slot order, then its own.
    int64_t row0 = 0, n_null = 0;
    for (int64_t i = 0; i < rows; ++i) {
      row0 += r.ids[static_cast<size_t>(i)] < null_slot;
      n_null += r.ids[static_cast<size_t>(i)] == null_slot;
    }
    ASSERT_GT(n_null, 0) << what << ": the null slot must get rows";
    got.erase(got.begin() + row0 * hidden, got.begin() + (row0 + n_null) * hidden);
    ref.erase(ref.begin() + row0 * hidden, ref.begin() + (row0 + n_null) * hidden);
    testing::expect_parity(got, ref, testing::kTolBf16Out, what);
    return;
  }
  testing::expect_parity(got, ref, testing::kTolBf16Out, what);
  EXPECT_EQ(L.dispatch->error_word(), 0) << what;
  for (bool gather : {false, true}) {  // the same rows, gathered by the kernel or not: the same bits
    y.fill_bytes(0xff);
    run(st.s, gather);
    BG_CUDA_CHECK(cudaStreamSynchronize(st.s));
    EXPECT_TRUE(cuda::download<uint16_t>(y, bits.size()) == bits)
        << what << (gather ? ": the fused gather gave different bits" : ": an eager rerun gave different bits");
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BG_CUDA_CHECK(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
  run(st.s, true);
  BG_CUDA_CHECK(cudaStreamEndCapture(st.s, &graph));
  BG_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    y.fill_bytes(0xff);
    BG_CUDA_CHECK(cudaGraphLaunch(exec, st.s));
    BG_CUDA_CHECK(cudaStreamSynchronize(st.s));
    EXPECT_TRUE(cuda::download<uint16_t>(y, bits.size()) == bits) << what << ": graph replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Every tile size and edge on small odd shapes (hidden 96: a partial k-stage; inter 160: a partial item): with the
// same 3 experts for every token each gets n rows, so n = 32 / 33 / 64 / 65 / 128 / 129 / 300 walk the N = 32 / 64 /
// 128 tiles and their edges; random routings give ragged counts and empty slots.
TEST(MoeW4a16Prefill, SmallOddShapes) {
  BG_REQUIRE_GPU();
  const ExpertSet set = make_experts(10, 96, 160, 11);
  for (int64_t n : {1, 11, 32, 33, 64, 65, 128, 129, 300}) {
    check_prefill("odd swiglu", set, 96, 160, 3, MoeW4a16Act::kSwiGLU, {n, Pattern::kSame}, 200 + n);
  }
  for (int64_t n : {5, 100, 400}) {
    check_prefill("odd situ", set, 96, 160, 3, MoeW4a16Act::kSiTU, {n, Pattern::kRandom, 7}, 210 + n);
  }
  check_prefill("odd situ", set, 96, 160, 3, MoeW4a16Act::kSiTU, {200, Pattern::kRandom, 7}, 230, 2);
}

TEST(MoeW4a16Prefill, KimiK3LatentExperts) {
  BG_REQUIRE_GPU();
  // 3584 -> 3072 -> 3584, SiTU, top-16 of 20 slots: ~120 rows per expert at 150 tokens (random), 40 (the same 16).
  const ExpertSet set = make_experts(20, 3584, 3072, 12);
  check_prefill("kimi-k3", set, 3584, 3072, 16, MoeW4a16Act::kSiTU, {150, Pattern::kRandom}, 240);
  check_prefill("kimi-k3", set, 3584, 3072, 16, MoeW4a16Act::kSiTU, {40, Pattern::kSame}, 241);
}

TEST(MoeW4a16Prefill, DeepSeekV3Experts) {
  BG_REQUIRE_GPU();
  // 7168 -> 2048 -> 7168, SwiGLU, top-8 of 12 slots: ~100 rows per expert.
  const ExpertSet set = make_experts(12, 7168, 2048, 13);
  check_prefill("deepseek-v3", set, 7168, 2048, 8, MoeW4a16Act::kSwiGLU, {150, Pattern::kRandom}, 250);
}

TEST(MoeW4a16Prefill, ZeroTokensAndBadInput) {
  BG_REQUIRE_GPU();
  const ExpertSet set = make_experts(4, 64, 64, 14);
  Stream st;
  Launch L;
  prepare(L, set, 64, 64, 2, MoeW4a16Act::kSwiGLU, {0}, Routing{}, 260, st.s);
  const MoeW4a16Params p = moe_w4a16_rows_params(L.mp);
  cuda::DeviceBuffer ws(moe_w4a16_prefill_workspace_bytes(p, false));
  moe_w4a16_prefill_cuda(p, set.layer.weights, L.dws, {nullptr, false, nullptr, nullptr, ws.data()}, st.s);  // no-op
  BG_CUDA_CHECK(cudaStreamSynchronize(st.s));
  EXPECT_EQ(L.dispatch->error_word(), 0);
  Launch M;
  prepare(M, set, 64, 64, 2, MoeW4a16Act::kSwiGLU, {3}, make_routing(3, 2, 4, 4, Pattern::kRandom, 261), 261, st.s);
  const MoeW4a16Params q = moe_w4a16_rows_params(M.mp);
  cuda::DeviceBuffer h(3 * 2 * 64 * 2), y(3 * 2 * 64 * 2);
  auto* hp = h.as<__nv_bfloat16>();
  auto* yp = y.as<__nv_bfloat16>();
  const MoeW4a16PrefillIo io{M.dws.x_perm, false, hp, yp, ws.data()};
  EXPECT_THROW(moe_w4a16_prefill_cuda(M.p, set.layer.weights, M.dws, io, st.s), Error)
      << "the combine params (not rows out) are refused";
  MoeW4a16Weights old = set.layer.weights;
  old.info.version = kMoeW4a16LayoutVersion + 1;
  EXPECT_THROW(moe_w4a16_prefill_cuda(q, old, M.dws, io, st.s), Error);
  MoeW4a16PrefillIo bad = io;
  bad.workspace = nullptr;
  EXPECT_THROW(moe_w4a16_prefill_cuda(q, set.layer.weights, M.dws, bad, st.s), Error);
  bad = io;
  bad.x = nullptr;
  EXPECT_THROW(moe_w4a16_prefill_cuda(q, set.layer.weights, M.dws, bad, st.s), Error);
  MoeWorkspace no_tokens = M.dws;
  no_tokens.row_token = nullptr;
  bad = io;
  bad.gather = true;
  EXPECT_THROW(moe_w4a16_prefill_cuda(q, set.layer.weights, no_tokens, bad, st.s), Error) << "gather needs row_token";
}

}  // namespace
}  // namespace bg::ops

// The device MoE stages against the CPU reference (ops/moe/moe.h): dispatch (counts, offsets, the permutation, the
// expert -> slot map with experts of other ranks) must equal moe_dispatch_cpu exactly; gather must copy rows bit for
// bit; combine and the whole routed path (gate/up -> SwiGLU or SiTU -> down, MXFP4 / FP8 / bf16 experts, skinny and
// tiled kernels) must match the CPU stages over linear_cpu on the same bf16 inputs within 1e-2 of max |ref| (bf16
// outputs; h and y are rounded to bf16 on the device). Bad ids and missing slots raise the error word instead of
// trapping. Shapes: real DeepSeek-V3 (7168 <-> 2048, top-8) and Kimi-K3 latent (3584 <-> 3072, top-16) experts, ragged
// FP8 / bf16 widths, token counts 0..1000, and routings that leave experts empty.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "cuda/moe_testing.h"
#include "ops/moe/moe.h"
#include "ops/moe/moe_cuda.h"

namespace bg::ops {
namespace {

using namespace moe_testing;  // NOLINT: the shared MoE test helpers

// ---- Dispatch, gather, combine -------------------------------------------------------------------------------------

// live >= 0: the ids are the step's rows from row0 on, and the step's rows from `live` on are padding (their ids are
// overwritten with out-of-range values: the dispatch must not read them, nor flag them).
void check_dispatch(int64_t n, int64_t k, int64_t E, int64_t n_used, int64_t stride, uint64_t seed, int64_t live = -1,
                    int64_t row0 = 0) {
  const std::string what = fmt::format("n={} k={} E={} used={} stride={} live={} row0={}", n, k, E, n_used, stride,
                                       live, row0);
  const std::vector<int32_t> slot_map = slot_map_every(E, stride);
  const int64_t S = (E + stride - 1) / stride;
  const MoeCudaParams p = params(n, k, E, S, 72, 32);  // 72 % 8 == 0: the 16-byte gather path
  Routing r = random_routing(n, k, n_used, seed);
  const int64_t host_live = live < 0 ? -1 : std::clamp<int64_t>(live - row0, 0, n);
  if (live >= 0) {
    for (int64_t i = host_live * k; i < n * k; ++i) r.ids[static_cast<size_t>(i)] = static_cast<int32_t>(E + 7);
  }
  std::vector<float> x;
  const std::vector<uint16_t> x_bits = testing::random_bf16(static_cast<size_t>(n * p.hidden), 1.0f, seed + 1, &x);
  Workspace w(p, slot_map);
  cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights), d_x = cuda::upload(x_bits);
  cuda::DeviceBuffer d_live = cuda::upload(std::vector<int32_t>{static_cast<int32_t>(std::max<int64_t>(live, 0))});
  if (live >= 0) {
    w.ws.live_tokens = d_live.as<int32_t>();
    w.ws.live_row0 = static_cast<int32_t>(row0);
  }
  moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
  moe_gather_cuda(p, d_x.as<__nv_bfloat16>(), w.ws, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(w.error_word(), 0) << what;

  const HostRouting ref(p.shape, slot_map, r, host_live);
  const size_t pairs = static_cast<size_t>(n * k), US = static_cast<size_t>(S);
  EXPECT_EQ(download_ptr(w.ws.counts, US), std::vector<int32_t>(ref.r.counts, ref.r.counts + US)) << what;
  EXPECT_EQ(download_ptr(w.ws.offsets, US + 1), std::vector<int32_t>(ref.r.offsets, ref.r.offsets + US + 1)) << what;
  EXPECT_EQ(download_ptr(w.ws.tile_offsets, US + 1),
            std::vector<int32_t>(ref.r.tile_offsets, ref.r.tile_offsets + US + 1)) << what;
  const auto n_active = download_ptr(w.ws.n_active, 1);
  ASSERT_EQ(n_active[0], *ref.r.n_active) << what;
  EXPECT_EQ(download_ptr(w.ws.active, static_cast<size_t>(n_active[0])),
            std::vector<int32_t>(ref.r.active, ref.r.active + n_active[0])) << what;
  const size_t rows = static_cast<size_t>(ref.r.offsets[S]);
  if (stride == 1) {
    EXPECT_EQ(rows, live < 0 ? pairs : static_cast<size_t>(host_live * k)) << what;
  }
  EXPECT_EQ(download_ptr(w.ws.row_token, rows), std::vector<int32_t>(ref.r.row_token, ref.r.row_token + rows)) << what;
  EXPECT_EQ(download_ptr(w.ws.row_weight, rows), std::vector<float>(ref.r.row_weight, ref.r.row_weight + rows)) << what;
  EXPECT_EQ(download_ptr(w.ws.slot_row, pairs), std::vector<int32_t>(ref.r.slot_row, ref.r.slot_row + pairs)) << what;
  const auto x_perm = download_ptr(reinterpret_cast<const uint16_t*>(w.ws.x_perm), rows * p.hidden);
  for (size_t row = 0; row < rows; ++row) {
    const uint16_t* src = x_bits.data() + static_cast<size_t>(ref.r.row_token[row]) * p.hidden;
    ASSERT_TRUE(std::equal(src, src + p.hidden, x_perm.data() + row * p.hidden)) << what << " gathered row " << row;
  }
}

TEST(MoeCudaParity, DispatchAndGatherMatchCpu) {
  BG_REQUIRE_GPU();
  // Up to 1024 pairs (64 tokens of K3) the dispatch is one block; past that, three kernels.
  for (int64_t n : {0, 1, 3, 16, 64, 65, 100, 1000}) {
    check_dispatch(n, 8, 256, 256, 1, 10 + static_cast<uint64_t>(n));   // DeepSeek-V3
    check_dispatch(n, 16, 896, 896, 1, 20 + static_cast<uint64_t>(n));  // Kimi-K3
    check_dispatch(n, 8, 64, 40, 1, 30 + static_cast<uint64_t>(n));     // experts 40..63 never chosen
    check_dispatch(n, 16, 896, 896, 16, 40 + static_cast<uint64_t>(n)); // one EP16 rank's 56 slots
  }
  check_dispatch(5000, 16, 896, 896, 1, 50);  // many dispatch chunks
  check_dispatch(5000, 16, 896, 896, 3, 51);
  check_dispatch(16384, 16, 896, 896, 16, 52);  // a 16k-token prefill step on an EP16 rank: 1024 chunks
  check_dispatch(20000, 8, 256, 256, 1, 53);    // chunks not a multiple of 32 lanes
}

// A decode graph's padding rows (the step's rows from StepLayout::live_tokens() on) get no pairs: one-block and
// chunked dispatches, all-local and EP slot maps, a TP rank's rows starting past row 0.
TEST(MoeCudaParity, DispatchDropsPaddingRows) {
  BG_REQUIRE_GPU();
  for (const auto& [n, live, row0] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {24, 20, 0}, {24, 24, 0}, {1, 0, 0}, {64, 57, 0}, {64, 1, 0}, {12, 20, 12}, {12, 30, 12}, {100, 90, 0},
           {2000, 1500, 0}, {2000, 0, 0}}) {
    check_dispatch(n, 16, 896, 896, 1, 70 + static_cast<uint64_t>(n + live), live, row0);
    check_dispatch(n, 16, 896, 896, 16, 80 + static_cast<uint64_t>(n + live), live, row0);
    check_dispatch(n, 8, 256, 256, 1, 90 + static_cast<uint64_t>(n + live), live, row0);
  }
}

TEST(MoeCudaParity, BadIdsAndMissingSlotsRaiseErrorFlags) {
  BG_REQUIRE_GPU();
  const int64_t n = 40, k = 4, E = 32;
  Routing r = random_routing(n, k, E, 60);
  r.ids[5] = -3;
  r.ids[17] = static_cast<int32_t>(E + 100);
  MoeCudaParams p = params(n, k, E, E, 64, 32);
  Workspace w(p, slot_map_every(E, 1));
  cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights);
  moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());  // no trap: the context stays usable
  EXPECT_EQ(w.error_word(), kMoeErrorBadExpertId);
  EXPECT_EQ(download_ptr(w.ws.offsets + E, 1)[0], static_cast<int32_t>(n * k - 2));  // the bad pairs are dropped
  // all_local with a slot map that leaves experts out: kMoeErrorNoSlot.
  const Routing ok = random_routing(n, k, E, 61);
  p.shape = {n, k, E, E / 2, true};
  Workspace w2(p, slot_map_every(E, 2));
  cuda::DeviceBuffer d_ids2 = cuda::upload(ok.ids), d_w2 = cuda::upload(ok.weights);
  moe_dispatch_cuda(p, d_ids2.as<int32_t>(), d_w2.as<float>(), w2.ws, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(w2.error_word(), kMoeErrorNoSlot);
}

// Combine alone: y_perm is random; the CPU combine reads the same rows (the routings are equal, see above).
void check_combine(MoeOutType out_type, bool accumulate, int64_t hidden, int64_t stride, uint64_t seed) {
  const int64_t n = 100, k = 8, E = 64;
  const std::vector<int32_t> slot_map = slot_map_every(E, stride);
  MoeCudaParams p = params(n, k, E, (E + stride - 1) / stride, hidden, 32);
  p.out_type = out_type;
  p.accumulate = accumulate;
  const std::string what = fmt::format("out={} accumulate={} hidden={} stride={}",
                                       out_type == MoeOutType::kF32 ? "f32" : "bf16", accumulate, hidden, stride);
  const Routing r = random_routing(n, k, 48, seed);
  Workspace w(p, slot_map);
  cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights);
  moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
  std::vector<float> y;
  const std::vector<uint16_t> y_bits = testing::random_bf16(static_cast<size_t>(n * k * hidden), 2.0f, seed + 1, &y);
  BG_CUDA_CHECK(cudaMemcpy(w.ws.y_perm, y_bits.data(), y_bits.size() * 2, cudaMemcpyHostToDevice));
  // Initial output: random when accumulating (bf16-representable, so both dtypes start from the same values).
  std::vector<float> init;
  const std::vector<uint16_t> init_bits = testing::random_bf16(static_cast<size_t>(n * hidden), 1.0f, seed + 2, &init);
  const size_t out_elem = out_type == MoeOutType::kF32 ? 4 : 2;
  cuda::DeviceBuffer d_out(static_cast<size_t>(n * hidden) * out_elem);
  if (!accumulate) {
    d_out.fill_bytes(0xff);
  } else if (out_type == MoeOutType::kF32) {
    d_out = cuda::upload(init);
  } else {
    d_out = cuda::upload(init_bits);
  }
  moe_combine_cuda(p, w.ws, d_out.data(), nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  const size_t n_out = static_cast<size_t>(n * hidden);
  const std::vector<float> got = out_type == MoeOutType::kF32
                                     ? cuda::download<float>(d_out, n_out)
                                     : testing::from_bf16(cuda::download<uint16_t>(d_out, n_out));
  const HostRouting ref_routing(p.shape, slot_map, r);
  std::vector<float> ref = accumulate ? init : std::vector<float>(n_out, 0.0f);
  moe_combine_cpu(p.shape, ref_routing.r, y.data(), hidden, ref.data());
  const double tol = out_type == MoeOutType::kF32 ? testing::kTolF32 : testing::kTolBf16Out;
  testing::expect_parity(got, ref, tol, what);
}

TEST(MoeCudaParity, CombineMatchesCpu) {
  BG_REQUIRE_GPU();
  check_combine(MoeOutType::kBf16, false, 7168, 1, 50);
  check_combine(MoeOutType::kF32, true, 3584, 1, 51);
  check_combine(MoeOutType::kBf16, true, 512, 1, 52);
  check_combine(MoeOutType::kF32, false, 130, 1, 53);  // hidden % 8 != 0: scalar path
  check_combine(MoeOutType::kF32, true, 512, 4, 54);   // a quarter of the experts local: the rest left to exchanges
}

// ---- The whole routed path -----------------------------------------------------------------------------------------

struct FfnCase {
  const char* name;
  int64_t n_experts, top_k, n_used, hidden, inter;
  WeightFormat format;
  MoeGlu act;
  std::vector<int64_t> token_counts;
  MoeFfnPath path = MoeFfnPath::kAuto;
};

void run_ffn_case(const FfnCase& c, uint64_t seed) {
  const Experts ex = make_experts({c.n_experts, c.hidden, c.inter, c.format}, seed);
  for (int64_t n : c.token_counts) {
    const std::string what = fmt::format("{}: {} n={} path={}", c.name, weight_format_name(c.format), n,
                                         static_cast<int>(c.path));
    MoeCudaParams p = params(n, c.top_k, c.n_experts, c.n_experts, c.hidden, c.inter);
    p.expert_format = c.format;
    p.act = {c.act, 4.0f, 25.0f};
    p.path = c.path;
    const Routing r = random_routing(n, c.top_k, c.n_used, seed + static_cast<uint64_t>(n));
    std::vector<float> x;
    const std::vector<uint16_t> x_bits =
        testing::random_bf16(static_cast<size_t>(n * c.hidden), 1.0f, seed * 7 + static_cast<uint64_t>(n), &x);
    Workspace w(p, slot_map_every(c.n_experts, 1));
    cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights), d_x = cuda::upload(x_bits);
    cuda::DeviceBuffer d_out(static_cast<size_t>(std::max<int64_t>(1, n * c.hidden)) * 2);
    d_out.fill_bytes(0xff);
    moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
    moe_gather_cuda(p, d_x.as<__nv_bfloat16>(), w.ws, nullptr);
    moe_expert_ffn_cuda(p, ex.table.as<ExpertWeightsCuda>(), w.ws, nullptr);
    moe_combine_cuda(p, w.ws, d_out.data(), nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(w.error_word(), 0) << what;
    const std::vector<float> got =
        testing::from_bf16(cuda::download<uint16_t>(d_out, static_cast<size_t>(n * c.hidden)));
    testing::expect_parity(got, reference_moe(p, ex, r, x), testing::kTolBf16Out, what);
  }
}

const std::vector<int64_t> kAllCounts = {0, 1, 3, 16, 100, 1000};

TEST(MoeCudaParity, SmallAllFormatsAndCounts) {
  BG_REQUIRE_GPU();
  // 64 experts, only 40 ever chosen: empty experts on every path.
  run_ffn_case({"small swiglu", 64, 8, 40, 256, 128, WeightFormat::kMxfp4, MoeGlu::kSwiGlu, kAllCounts}, 1);
  run_ffn_case({"small situ", 64, 8, 40, 256, 128, WeightFormat::kFp8Block, MoeGlu::kSitu, kAllCounts}, 2);
  run_ffn_case({"small situ", 64, 16, 40, 256, 128, WeightFormat::kDense, MoeGlu::kSitu, kAllCounts}, 3);
}

TEST(MoeCudaParity, ForcedPaths) {
  BG_REQUIRE_GPU();
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kFp8Block, WeightFormat::kDense}) {
    run_ffn_case({"tiled at decode", 64, 8, 40, 256, 128, f, MoeGlu::kSwiGlu, {1, 3}, MoeFfnPath::kTiled}, 4);
    run_ffn_case({"skinny at prefill", 64, 8, 40, 256, 128, f, MoeGlu::kSitu, {100}, MoeFfnPath::kSkinny}, 5);
  }
}

TEST(MoeCudaParity, RaggedWidths) {
  BG_REQUIRE_GPU();
  // hidden 200 / inter 130: partial 128-blocks, partial tiles, and (for inter) the scalar load paths.
  for (WeightFormat f : {WeightFormat::kFp8Block, WeightFormat::kDense}) {
    run_ffn_case({"ragged", 16, 4, 16, 200, 130, f, MoeGlu::kSwiGlu, {1, 16, 100}}, 6);
    run_ffn_case({"ragged tiled", 16, 4, 16, 200, 130, f, MoeGlu::kSitu, {3}, MoeFfnPath::kTiled}, 7);
    run_ffn_case({"ragged skinny", 16, 4, 16, 200, 130, f, MoeGlu::kSitu, {100}, MoeFfnPath::kSkinny}, 8);
  }
}

TEST(MoeCudaParity, DeepSeekV3ExpertDims) {
  BG_REQUIRE_GPU();
  // Real expert shapes (gate/up 2048 x 7168, down 7168 x 2048), top-8, fewer experts to keep the CPU reference short.
  run_ffn_case({"deepseek-v3", 12, 8, 12, 7168, 2048, WeightFormat::kMxfp4, MoeGlu::kSwiGlu, {1, 16, 100}}, 9);
  run_ffn_case({"deepseek-v3", 12, 8, 12, 7168, 2048, WeightFormat::kFp8Block, MoeGlu::kSwiGlu, {1, 64}}, 10);
}

TEST(MoeCudaParity, KimiK3LatentExpertDims) {
  BG_REQUIRE_GPU();
  // Kimi-K3 latent experts (3584 -> 3072 -> 3584), SiTU, top-16 of 24.
  run_ffn_case({"kimi-k3", 24, 16, 24, 3584, 3072, WeightFormat::kMxfp4, MoeGlu::kSitu, {1, 3, 16, 40}}, 11);
}

TEST(MoeCudaParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  MoeCudaParams p = params(4, 8, 64, 64, 7168, 100);  // inter not a multiple of 32 for MXFP4
  p.expert_format = WeightFormat::kMxfp4;
  EXPECT_THROW(moe_check_params(p), Error);
  p.inter = 2048;
  p.shape.top_k = 65;
  EXPECT_THROW(moe_check_params(p), Error);
  p.shape.top_k = 8;
  EXPECT_NO_THROW(moe_check_params(p));
  p.shape.n_slots = 65;  // more slots than experts
  EXPECT_THROW(moe_check_params(p), Error);
}

}  // namespace
}  // namespace bg::ops

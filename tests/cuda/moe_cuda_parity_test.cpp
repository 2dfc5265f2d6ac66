// The device MoE path against the CPU references: dispatch (counts, offsets, the permutation) must equal
// group_by_expert exactly; gather must copy rows bit for bit; combine and the whole routed path (gate/up -> SwiGLU or
// SiTU -> down, MXFP4 / FP8 / bf16 experts, skinny and tiled kernels) must match run_routed_experts_loopback over
// linear_cpu on the same bf16 inputs within 1e-2 of max |ref| (bf16 outputs; h and y are rounded to bf16 on the
// device). Shapes: real DeepSeek-V3 (7168 <-> 2048, top-8) and Kimi-K3 latent (3584 <-> 3072, top-16) experts, ragged
// FP8 / bf16 widths, token counts 0..1000, and routings that leave experts empty.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "moe/moe_cuda.h"
#include "moe/routed_experts.h"
#include "ops/linear/linear.h"
#include "ops/situ/situ.h"
#include "ops/swiglu/swiglu.h"

namespace bg {
namespace {

using ops::DeviceWeightStorage;
using testing::HostWeight;

template <typename T>
std::vector<T> download_ptr(const T* p, size_t n) {
  std::vector<T> out(n);
  if (n > 0) BG_CUDA_CHECK(cudaMemcpy(out.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// Top-k routing: each token picks k distinct experts from [0, n_used) with positive weights.
struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routing random_routing(int64_t n, int64_t k, int64_t n_used, uint64_t seed) {
  Routing r;
  std::vector<int32_t> pool(static_cast<size_t>(n_used));
  for (int64_t t = 0; t < n; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates
      const uint64_t h = testing::mix64(seed ^ testing::mix64(static_cast<uint64_t>(t * 64 + j)));
      const int64_t pick = j + static_cast<int64_t>(h % static_cast<uint64_t>(n_used - j));
      std::swap(pool[static_cast<size_t>(j)], pool[static_cast<size_t>(pick)]);
      r.ids.push_back(pool[static_cast<size_t>(j)]);
      r.weights.push_back(0.55f + testing::hash_uniform(seed + 7, static_cast<uint64_t>(t * k + j), 0.45f));
    }
  }
  return r;
}

// One device workspace for p, poisoned (0xff) so that nothing passes by reading stale zeros.
struct Workspace {
  cuda::DeviceBuffer buf;
  MoeWorkspace ws;
  explicit Workspace(const MoeCudaParams& p) : buf(moe_workspace_bytes(p)) {
    buf.fill_bytes(0xff);
    ws = moe_workspace_layout(p, buf.data());
  }
};

// ---- Dispatch, gather, combine -------------------------------------------------------------------------------------

void check_dispatch(int64_t n, int64_t k, int64_t E, int64_t n_used, uint64_t seed) {
  const std::string what = fmt::format("n={} k={} E={} used={}", n, k, E, n_used);
  MoeCudaParams p;
  p.n_tokens = n;
  p.top_k = k;
  p.n_experts = E;
  p.hidden = 72;  // 72 % 8 == 0: the 16-byte gather path
  p.inter = 32;
  p.expert_format = WeightFormat::kDense;  // no FFN here; dense allows any width
  const Routing r = random_routing(n, k, n_used, seed);
  std::vector<float> x;
  const std::vector<uint16_t> x_bits = testing::random_bf16(static_cast<size_t>(n * p.hidden), 1.0f, seed + 1, &x);
  Workspace w(p);
  cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights), d_x = cuda::upload(x_bits);
  moe_dispatch_cuda(p, d_ids.as<int32_t>(), d_w.as<float>(), w.ws, nullptr);
  moe_gather_cuda(p, d_x.as<__nv_bfloat16>(), w.ws, nullptr);
  BG_CUDA_CHECK(cudaDeviceSynchronize());

  const ExpertDispatch ref = group_by_expert(r.ids.data(), r.weights.data(), n, k, E);
  const size_t slots = static_cast<size_t>(n * k);
  const auto counts = download_ptr(w.ws.counts, static_cast<size_t>(E));
  const auto offsets = download_ptr(w.ws.offsets, static_cast<size_t>(E + 1));
  const auto tiles = download_ptr(w.ws.tile_offsets, static_cast<size_t>(E + 1));
  const auto n_active = download_ptr(w.ws.n_active, 1);
  const auto active = download_ptr(w.ws.active, static_cast<size_t>(n_active[0]));
  std::vector<int32_t> want_active;
  int32_t want_tiles = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = ref.offsets[static_cast<size_t>(e + 1)] - ref.offsets[static_cast<size_t>(e)];
    ASSERT_EQ(counts[static_cast<size_t>(e)], c) << what << " expert " << e;
    ASSERT_EQ(offsets[static_cast<size_t>(e)], ref.offsets[static_cast<size_t>(e)]) << what << " expert " << e;
    ASSERT_EQ(tiles[static_cast<size_t>(e)], want_tiles) << what << " expert " << e;
    want_tiles += static_cast<int32_t>((c + kMoeTileRows - 1) / kMoeTileRows);
    if (c > 0) want_active.push_back(static_cast<int32_t>(e));
  }
  EXPECT_EQ(offsets[static_cast<size_t>(E)], static_cast<int32_t>(slots)) << what;
  EXPECT_EQ(tiles[static_cast<size_t>(E)], want_tiles) << what;
  EXPECT_EQ(active, want_active) << what;
  if (n_used < E && n > 0) {
    EXPECT_LT(want_active.size(), static_cast<size_t>(n_used) + 1) << what << ": experts past n_used were chosen";
  }

  const auto row_token = download_ptr(w.ws.row_token, slots);
  const auto row_weight = download_ptr(w.ws.row_weight, slots);
  const auto slot_row = download_ptr(w.ws.slot_row, slots);
  for (size_t row = 0; row < slots; ++row) {
    ASSERT_EQ(row_token[row], ref.token_idx[row]) << what << " row " << row;
    ASSERT_EQ(row_weight[row], ref.slot_weight[row]) << what << " row " << row;
  }
  for (size_t i = 0; i < slots; ++i) {
    ASSERT_EQ(row_token[static_cast<size_t>(slot_row[i])], static_cast<int32_t>(i / static_cast<size_t>(k))) << what;
  }
  const auto x_perm = download_ptr(reinterpret_cast<const uint16_t*>(w.ws.x_perm), slots * p.hidden);
  for (size_t row = 0; row < slots; ++row) {
    const uint16_t* src = x_bits.data() + static_cast<size_t>(row_token[row]) * p.hidden;
    ASSERT_TRUE(std::equal(src, src + p.hidden, x_perm.data() + row * p.hidden)) << what << " gathered row " << row;
  }
}

TEST(MoeCudaParity, DispatchAndGatherMatchGroupByExpert) {
  BG_REQUIRE_GPU();
  for (int64_t n : {0, 1, 3, 16, 100, 1000}) {
    check_dispatch(n, 8, 256, 256, 10 + static_cast<uint64_t>(n));  // DeepSeek-V3
    check_dispatch(n, 16, 896, 896, 20 + static_cast<uint64_t>(n));  // Kimi-K3
    check_dispatch(n, 8, 64, 40, 30 + static_cast<uint64_t>(n));     // experts 40..63 never chosen
  }
  check_dispatch(5000, 16, 896, 896, 40);  // many dispatch chunks
}

// Combine alone: y_perm is random, the CPU "expert" returns the same rows (the permutations are equal, see above).
void check_combine(MoeOutType out_type, bool accumulate, int64_t hidden, uint64_t seed) {
  const int64_t n = 100, k = 8, E = 64;
  MoeCudaParams p;
  p.n_tokens = n;
  p.top_k = k;
  p.n_experts = E;
  p.hidden = hidden;
  p.inter = 32;
  p.expert_format = WeightFormat::kDense;  // no FFN here; dense allows any width
  p.out_type = out_type;
  p.accumulate = accumulate;
  const std::string what = fmt::format("out={} accumulate={} hidden={}", out_type == MoeOutType::kF32 ? "f32" : "bf16",
                                       accumulate, hidden);
  const Routing r = random_routing(n, k, 48, seed);
  Workspace w(p);
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

  const ExpertDispatch d = group_by_expert(r.ids.data(), r.weights.data(), n, k, E);
  std::vector<float> ref = accumulate ? init : std::vector<float>(static_cast<size_t>(n * hidden), 0.0f);
  std::vector<float> x(static_cast<size_t>(n * hidden), 0.0f);
  run_routed_experts_loopback(d, x.data(), n, hidden, hidden, [&](int64_t e, const float*, int64_t rows, float* out) {
    const float* src = y.data() + d.offsets[static_cast<size_t>(e)] * hidden;
    std::copy(src, src + rows * hidden, out);
  }, ref.data());
  const double tol = out_type == MoeOutType::kF32 ? testing::kTolF32 : testing::kTolBf16Out;
  testing::expect_parity(got, ref, tol, what);
}

TEST(MoeCudaParity, CombineMatchesLoopback) {
  BG_REQUIRE_GPU();
  check_combine(MoeOutType::kBf16, false, 7168, 50);
  check_combine(MoeOutType::kF32, true, 3584, 51);
  check_combine(MoeOutType::kBf16, true, 512, 52);
  check_combine(MoeOutType::kF32, false, 130, 53);  // hidden % 8 != 0: scalar path
}

// ---- The whole routed path -----------------------------------------------------------------------------------------

struct FfnCase {
  const char* name;
  int64_t n_experts, top_k, n_used, hidden, inter;
  WeightFormat format;
  GluActivation act;
  std::vector<int64_t> token_counts;
  MoeFfnPath path = MoeFfnPath::kAuto;
};

struct Experts {
  std::vector<HostWeight> gate, up, down;
  std::vector<DeviceWeightStorage> storage;
  cuda::DeviceBuffer table;  // ExpertWeightsCuda [n_experts]
};

Experts make_experts(const FfnCase& c, uint64_t seed) {
  Experts ex;
  std::vector<ExpertWeightsCuda> descs;
  const size_t E = static_cast<size_t>(c.n_experts);
  ex.gate.reserve(E);
  ex.up.reserve(E);
  ex.down.reserve(E);
  ex.storage.reserve(3 * E);
  const float s_in = 1.0f / std::sqrt(static_cast<float>(c.hidden));
  const float s_mid = 2.0f / std::sqrt(static_cast<float>(c.inter));
  for (int64_t e = 0; e < c.n_experts; ++e) {
    const uint64_t base = seed * 1000 + static_cast<uint64_t>(e) * 3;
    ex.gate.push_back(testing::random_weight(c.format, c.inter, c.hidden, s_in, base));
    ex.up.push_back(testing::random_weight(c.format, c.inter, c.hidden, s_in, base + 1));
    ex.down.push_back(testing::random_weight(c.format, c.hidden, c.inter, s_mid, base + 2));
    ExpertWeightsCuda d;
    ex.storage.push_back(ops::upload_weight(ex.gate.back().w));
    d.gate = ex.storage.back().desc;
    ex.storage.push_back(ops::upload_weight(ex.up.back().w));
    d.up = ex.storage.back().desc;
    ex.storage.push_back(ops::upload_weight(ex.down.back().w));
    d.down = ex.storage.back().desc;
    descs.push_back(d);
  }
  ex.table = cuda::upload_bytes(descs.data(), descs.size() * sizeof(ExpertWeightsCuda));
  return ex;
}

std::vector<float> reference_moe(const FfnCase& c, const Experts& ex, const Routing& r, const std::vector<float>& x,
                                 int64_t n, const GluParams& act) {
  const ExpertDispatch d = group_by_expert(r.ids.data(), r.weights.data(), n, c.top_k, c.n_experts);
  std::vector<float> out(static_cast<size_t>(n * c.hidden), 0.0f);
  run_routed_experts_loopback(d, x.data(), n, c.hidden, c.hidden, [&](int64_t e, const float* in, int64_t rows,
                                                                       float* y) {
    const size_t ue = static_cast<size_t>(e);
    std::vector<float> g(static_cast<size_t>(rows * c.inter)), u(g.size());
    ops::linear_cpu(ex.gate[ue].w, in, rows, g.data());
    ops::linear_cpu(ex.up[ue].w, in, rows, u.data());
    if (act.kind == GluActivation::kSwiGLU) {
      ops::swiglu_cpu(g.data(), u.data(), rows * c.inter, g.data());
    } else {
      ops::situ_cpu({rows, c.inter, act.beta, act.beta_lin}, g.data(), u.data(), g.data());
    }
    ops::linear_cpu(ex.down[ue].w, g.data(), rows, y);
  }, out.data());
  return out;
}

void run_ffn_case(const FfnCase& c, uint64_t seed) {
  const Experts ex = make_experts(c, seed);
  for (int64_t n : c.token_counts) {
    const std::string what = fmt::format("{}: {} n={} path={}", c.name, weight_format_name(c.format), n,
                                         static_cast<int>(c.path));
    MoeCudaParams p;
    p.n_tokens = n;
    p.top_k = c.top_k;
    p.n_experts = c.n_experts;
    p.hidden = c.hidden;
    p.inter = c.inter;
    p.expert_format = c.format;
    p.act = {c.act, 4.0f, 25.0f};
    p.path = c.path;
    const Routing r = random_routing(n, c.top_k, c.n_used, seed + static_cast<uint64_t>(n));
    std::vector<float> x;
    const std::vector<uint16_t> x_bits =
        testing::random_bf16(static_cast<size_t>(n * c.hidden), 1.0f, seed * 7 + static_cast<uint64_t>(n), &x);
    Workspace w(p);
    cuda::DeviceBuffer d_ids = cuda::upload(r.ids), d_w = cuda::upload(r.weights), d_x = cuda::upload(x_bits);
    cuda::DeviceBuffer d_out(static_cast<size_t>(n * c.hidden) * 2);
    d_out.fill_bytes(0xff);
    const MoeCudaArgs args{d_ids.as<int32_t>(), d_w.as<float>(), d_x.as<__nv_bfloat16>(),
                           ex.table.as<ExpertWeightsCuda>(), d_out.data()};
    moe_routed_experts_cuda(p, args, w.ws, nullptr);
    BG_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got =
        testing::from_bf16(cuda::download<uint16_t>(d_out, static_cast<size_t>(n * c.hidden)));
    const std::vector<float> ref = reference_moe(c, ex, r, x, n, p.act);
    testing::expect_parity(got, ref, testing::kTolBf16Out, what);
  }
}

const std::vector<int64_t> kAllCounts = {0, 1, 3, 16, 100, 1000};

TEST(MoeCudaParity, SmallAllFormatsAndCounts) {
  BG_REQUIRE_GPU();
  // 64 experts, only 40 ever chosen: empty experts on every path.
  run_ffn_case({"small swiglu", 64, 8, 40, 256, 128, WeightFormat::kMxfp4, GluActivation::kSwiGLU, kAllCounts}, 1);
  run_ffn_case({"small situ", 64, 8, 40, 256, 128, WeightFormat::kFp8Block, GluActivation::kSiTU, kAllCounts}, 2);
  run_ffn_case({"small situ", 64, 16, 40, 256, 128, WeightFormat::kDense, GluActivation::kSiTU, kAllCounts}, 3);
}

TEST(MoeCudaParity, ForcedPaths) {
  BG_REQUIRE_GPU();
  for (WeightFormat f : {WeightFormat::kMxfp4, WeightFormat::kFp8Block, WeightFormat::kDense}) {
    run_ffn_case({"tiled at decode", 64, 8, 40, 256, 128, f, GluActivation::kSwiGLU, {1, 3}, MoeFfnPath::kTiled}, 4);
    run_ffn_case({"skinny at prefill", 64, 8, 40, 256, 128, f, GluActivation::kSiTU, {100}, MoeFfnPath::kSkinny}, 5);
  }
}

TEST(MoeCudaParity, RaggedWidths) {
  BG_REQUIRE_GPU();
  // hidden 200 / inter 130: partial 128-blocks, partial tiles, and (for inter) the scalar load paths.
  for (WeightFormat f : {WeightFormat::kFp8Block, WeightFormat::kDense}) {
    run_ffn_case({"ragged", 16, 4, 16, 200, 130, f, GluActivation::kSwiGLU, {1, 16, 100}}, 6);
    run_ffn_case({"ragged tiled", 16, 4, 16, 200, 130, f, GluActivation::kSiTU, {3}, MoeFfnPath::kTiled}, 7);
    run_ffn_case({"ragged skinny", 16, 4, 16, 200, 130, f, GluActivation::kSiTU, {100}, MoeFfnPath::kSkinny}, 8);
  }
}

TEST(MoeCudaParity, DeepSeekV3ExpertDims) {
  BG_REQUIRE_GPU();
  // Real expert shapes (gate/up 2048 x 7168, down 7168 x 2048), top-8, fewer experts to keep the CPU reference short.
  run_ffn_case({"deepseek-v3", 12, 8, 12, 7168, 2048, WeightFormat::kMxfp4, GluActivation::kSwiGLU, {1, 16, 100}}, 9);
  run_ffn_case({"deepseek-v3", 12, 8, 12, 7168, 2048, WeightFormat::kFp8Block, GluActivation::kSwiGLU, {1, 64}}, 10);
}

TEST(MoeCudaParity, KimiK3LatentExpertDims) {
  BG_REQUIRE_GPU();
  // Kimi-K3 latent experts (3584 -> 3072 -> 3584), SiTU, top-16 of 24.
  run_ffn_case({"kimi-k3", 24, 16, 24, 3584, 3072, WeightFormat::kMxfp4, GluActivation::kSiTU, {1, 3, 16, 40}}, 11);
}

TEST(MoeCudaParity, RejectsBadParams) {
  BG_REQUIRE_GPU();
  MoeCudaParams p;
  p.n_tokens = 4;
  p.top_k = 8;
  p.n_experts = 64;
  p.hidden = 7168;
  p.inter = 100;  // not a multiple of 32 for MXFP4
  EXPECT_THROW(moe_workspace_bytes(p), Error);
  p.inter = 2048;
  p.top_k = 65;
  EXPECT_THROW(moe_workspace_bytes(p), Error);
  p.top_k = 8;
  EXPECT_GT(moe_workspace_bytes(p), size_t{0});
}

}  // namespace
}  // namespace bg

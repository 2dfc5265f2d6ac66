// The CUDA backend's expert slots: one layer's MXFP4 experts, prepared as a batch, stay on the host until their slots
// are prepared, and the layer then holds them in the W4A16 layout only — on one rank and on an expert-parallel rank
// alike — and runs every MoE path from it (a rank's rows through the kernel's rows-in / rows-out mode). A streamed
// layer, or BG_MOE_W4A16=0 at load, keeps them in the checkpoint's format for the stage kernels. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_moe.h"
#include "core/error.h"
#include "cuda/cuda_testing.h"
#include "cuda/linear_moe_testing.h"
#include "moe/expert_table.h"

namespace bg::testing {
namespace {

// One MoE layer's experts prepared the way the model prepares them: one batch, expert-major (gate, up, down).
struct Layer {
  std::deque<HostWeight> host;  // the handles' host views point into these
  PreparedLinears prepared;
  ExpertWeights all;
};

Layer make_layer(Backend& be, int64_t n_experts, int64_t hidden, int64_t inter) {
  Layer l;
  LinearBatch batch;
  batch.n_experts = n_experts;
  for (int64_t e = 0; e < n_experts; ++e) {
    const auto seed = static_cast<uint64_t>(3 * e);
    l.host.push_back(random_weight(WeightFormat::kMxfp4, inter, hidden, 0.1f, seed));
    l.host.push_back(random_weight(WeightFormat::kMxfp4, inter, hidden, 0.1f, seed + 1));
    l.host.push_back(random_weight(WeightFormat::kMxfp4, hidden, inter, 0.1f, seed + 2));
  }
  for (const HostWeight& h : l.host) batch.weights.push_back(&h.w);
  l.prepared = be.prepare_linears(batch);
  for (int64_t e = 0; e < n_experts; ++e) {
    const auto i = static_cast<size_t>(3 * e);
    l.all.gate.push_back(l.prepared.weights[i].get());
    l.all.up.push_back(l.prepared.weights[i + 1].get());
    l.all.down.push_back(l.prepared.weights[i + 2].get());
  }
  return l;
}

// Rank `rank` of `ranks` holds a contiguous share; the others' entries are null.
ExpertWeights share(const ExpertWeights& all, int64_t ranks, int64_t rank) {
  ExpertWeights w = all;
  const moe::ExpertPlacement p = moe::ExpertPlacement::contiguous(all.size(), ranks, rank);
  for (int64_t e = 0; e < all.size(); ++e) {
    const auto i = static_cast<size_t>(e);
    if (p.owner(e) != rank) w.gate[i] = w.up[i] = w.down[i] = nullptr;
  }
  return w;
}

const cuda::CudaExpertSlots& slots_of(const moe::ExpertTable& t) {
  return dynamic_cast<const cuda::CudaExpertSlots&>(t.slots());
}

TEST(CudaExpertSlots, MxFp4ExpertsLiveInTheDecodeLayoutOnly) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  constexpr int64_t kExperts = 4, kHidden = 64, kInter = 96;
  const Layer l = make_layer(*be, kExperts, kHidden, kInter);
  for (const auto& h : l.prepared.weights) EXPECT_EQ(cuda::cuda_linear(*h).desc().data, nullptr) << "uploaded twice";

  const moe::ExpertTable one(*be, moe::ExpertPlacement::contiguous(kExperts, 1, 0), l.all);
  EXPECT_NE(slots_of(one).w4a16(), nullptr);
  EXPECT_FALSE(slots_of(one).stages());
  const moe::ExpertTable ep(*be, moe::ExpertPlacement::contiguous(kExperts, 2, 0), share(l.all, 2, 0));
  EXPECT_FALSE(ep.all_local());
  EXPECT_EQ(ep.n_slots(), 2);
  EXPECT_NE(slots_of(ep).w4a16(), nullptr) << "an expert-parallel rank runs the decode kernel too";
  EXPECT_FALSE(slots_of(ep).stages());

  // A linear on an expert's handle has nothing to read: refused, not a null dereference on the device.
  Tensor x = be->act(1, kHidden), y = be->act(1, kInter);
  be->fill_zero(x);
  EXPECT_THROW(be->linear(*l.all.gate[0], x, y), Error);

  // A streamed layer keeps the layout too: its resident slots packed now, the streamed ones pointed later at blocks
  // laid out on the device (expert_layout_bytes each); pointing one without its block is refused.
  ExpertWeights streamed = l.all;
  streamed.streamed = true;
  streamed.streamed_slots = {false, true, false, true};
  for (int e : {1, 3}) {
    for (const HostWeight* h : {&l.host[3 * e], &l.host[3 * e + 1], &l.host[3 * e + 2]}) {
      streamed.streamed_host.push_back(&h->w);
    }
  }
  std::unique_ptr<ExpertSlots> s = be->prepare_experts(streamed);
  const auto& cs = dynamic_cast<const cuda::CudaExpertSlots&>(*s);
  ASSERT_NE(cs.w4a16(), nullptr);
  EXPECT_FALSE(cs.stages());
  EXPECT_EQ(be->expert_layout_bytes(*s), static_cast<size_t>(cs.w4a16()->info.block_bytes));
  EXPECT_THROW(be->set_expert_slot(*s, 1, *l.all.gate[1], *l.all.up[1], *l.all.down[1]), Error);

  // BG_MOE_W4A16=0 at load: the checkpoint's format on the device, the stage kernels.
  ::setenv("BG_MOE_W4A16", "0", 1);
  const Layer plain = make_layer(*be, kExperts, kHidden, kInter);
  const moe::ExpertTable stage(*be, moe::ExpertPlacement::contiguous(kExperts, 1, 0), plain.all);
  ::unsetenv("BG_MOE_W4A16");
  EXPECT_NE(cuda::cuda_linear(*plain.all.gate[0]).desc().data, nullptr);
  EXPECT_EQ(slots_of(stage).w4a16(), nullptr);
  EXPECT_TRUE(slots_of(stage).stages());
}

// Every present slot's block of a layer in the W4A16 layout (null for a streamed slot), downloaded.
std::vector<std::vector<std::byte>> blocks_of(const cuda::CudaExpertSlots& s) {
  const ops::MoeW4a16Weights* w = s.w4a16();
  EXPECT_NE(w, nullptr);
  if (w == nullptr) return {};
  std::vector<const void*> table(static_cast<size_t>(w->info.n_slots));
  BG_CUDA_CHECK(cudaMemcpy(table.data(), w->blocks, table.size() * sizeof(void*), cudaMemcpyDeviceToHost));
  std::vector<std::vector<std::byte>> out;
  for (const void* b : table) {
    out.emplace_back(b == nullptr ? 0 : static_cast<size_t>(w->info.block_bytes));
    if (b != nullptr) BG_CUDA_CHECK(cudaMemcpy(out.back().data(), b, out.back().size(), cudaMemcpyDeviceToHost));
  }
  return out;
}

// BG_MOE_W4A16_PACK=device (the default) at load (the checkpoint's bytes staged on the device a chunk at a time,
// packed there) gives the layout the host packer gives, byte for byte: one rank, an expert-parallel rank and a
// streamed layer, with chunks of 1, 2 and all experts.
TEST(CudaExpertSlots, DevicePackAtLoadEqualsHostPack) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  constexpr int64_t kExperts = 5, kHidden = 96, kInter = 64;
  const Layer l = make_layer(*be, kExperts, kHidden, kInter);
  ExpertWeights streamed = l.all;
  streamed.streamed = true;
  streamed.streamed_slots = {false, true, false, false, true};
  for (int e : {1, 4}) {
    for (const HostWeight* h : {&l.host[3 * e], &l.host[3 * e + 1], &l.host[3 * e + 2]}) {
      streamed.streamed_host.push_back(&h->w);
    }
  }
  // One rank, rank 1 of two expert-parallel ranks, the streamed layer.
  auto pack_all = [&] {
    const moe::ExpertTable one(*be, moe::ExpertPlacement::contiguous(kExperts, 1, 0), l.all);
    const moe::ExpertTable ep(*be, moe::ExpertPlacement::contiguous(kExperts, 2, 1), share(l.all, 2, 1));
    const std::unique_ptr<ExpertSlots> st = be->prepare_experts(streamed);
    return std::vector{blocks_of(slots_of(one)), blocks_of(slots_of(ep)),
                       blocks_of(dynamic_cast<const cuda::CudaExpertSlots&>(*st))};
  };
  ::setenv("BG_MOE_W4A16_PACK", "host", 1);
  const std::vector<std::vector<std::vector<std::byte>>> host_packed = pack_all();
  const size_t block = host_packed[0][0].size();
  ASSERT_GT(block, 0u);
  ::setenv("BG_MOE_W4A16_PACK", "device", 1);
  for (size_t chunk : {block, 2 * block + 1, size_t{1} << 30}) {
    ::setenv("BG_MOE_W4A16_PACK_CHUNK_BYTES", std::to_string(chunk).c_str(), 1);
    const std::vector<std::vector<std::vector<std::byte>>> dev = pack_all();
    ASSERT_EQ(dev.size(), host_packed.size());
    for (size_t i = 0; i < dev.size(); ++i) {
      ASSERT_EQ(dev[i].size(), host_packed[i].size()) << "layer " << i;
      for (size_t s = 0; s < dev[i].size(); ++s) {
        EXPECT_TRUE(dev[i][s] == host_packed[i][s]) << "layer " << i << " slot " << s << ", chunk of " << chunk
                                                    << " B: " << dev[i][s].size() << " / " << host_packed[i][s].size()
                                                    << " bytes";
      }
    }
  }
  ::unsetenv("BG_MOE_W4A16_PACK_CHUNK_BYTES");
  ::unsetenv("BG_MOE_W4A16_PACK");
  EXPECT_EQ(host_packed[1].size(), 2u) << "rank 1 of two holds experts 3 and 4 of five";
  size_t present = 0;
  for (const auto& b : host_packed[2]) present += b.empty() ? 0 : 1;
  EXPECT_EQ(present, 3u) << "the streamed layer's two streamed slots have no block at load";
}

// The layer's MoE on two expert-parallel ranks (each: its own dispatch, gather, experts with rows out, combine into
// the same fp32 output) equals the one-rank fused kernel's result within the bf16 output tolerance.
TEST(CudaExpertSlots, ExpertParallelRanksMatchOneRank) {
  BG_REQUIRE_GPU();
  auto be = make_backend("cuda");
  constexpr int64_t kExperts = 8, kHidden = 256, kInter = 128, kTopK = 3;
  const Layer l = make_layer(*be, kExperts, kHidden, kInter);
  const GluSpec glu{GluKind::kSitu, 4.0f, 25.0f};
  for (int64_t n : {1, 5, 40}) {
    std::vector<float> x_host;
    (void)random_bf16(static_cast<size_t>(n * kHidden), 1.0f, 7 + static_cast<uint64_t>(n), &x_host);
    std::vector<int32_t> ids;
    std::vector<float> weights;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t k = 0; k < kTopK; ++k) {
        ids.push_back(static_cast<int32_t>((t * 5 + k * 3) % kExperts));  // distinct per token (3 and 8 coprime)
        weights.push_back(0.3f + 0.2f * static_cast<float>(k));
      }
    }
    const Tensor x = be->upload_f32(x_host, {n, kHidden}, DType::kBF16);
    Tensor d_ids = be->alloc({n, kTopK}, DType::kI32);
    be->write_bytes(d_ids, std::as_bytes(std::span(ids)));
    const Tensor d_w = be->upload_f32(weights, {n, kTopK}, DType::kF32);

    const moe::ExpertTable one(*be, moe::ExpertPlacement::contiguous(kExperts, 1, 0), l.all);
    MoeRouting r1 = be->moe_routing({n, kTopK, kExperts, kExperts, true});
    be->moe_dispatch(one.slot_map(), d_ids, d_w, r1, -1);
    Tensor out_one = be->zeros({n, kHidden}, DType::kF32);
    be->moe_routed_local(one.slots(), glu, r1, x, out_one, /*accumulate=*/true);

    Tensor out_ep = be->zeros({n, kHidden}, DType::kF32);
    for (int64_t rank = 0; rank < 2; ++rank) {
      const moe::ExpertTable t(*be, moe::ExpertPlacement::contiguous(kExperts, 2, rank), share(l.all, 2, rank));
      MoeRouting r = be->moe_routing({n, kTopK, kExperts, t.n_slots(), false});
      be->moe_dispatch(t.slot_map(), d_ids, d_w, r, -1);
      Tensor rows = be->act(n * kTopK, kHidden), y = be->act(n * kTopK, kHidden);
      be->moe_gather(r, x, rows);
      be->moe_experts(t.slots(), glu, r, rows, y);
      be->moe_combine(r, y, out_ep);
    }
    std::vector<float> a(static_cast<size_t>(n * kHidden)), b(a.size());
    be->download_f32(out_one, a.data());
    be->download_f32(out_ep, b.data());
    expect_parity(b, a, kTolBf16Out, fmt::format("{} tokens on two ranks", n));
  }
}

}  // namespace
}  // namespace bg::testing

// cuda::WeightUploader against the bytes it was given: batches of dense F32/F16/BF16, FP8-block and MXFP4 weights
// from pageable memory, from pinned (cudaHostRegister'd) memory and mixed, the expert-block layout of an expert batch,
// windows larger than the staging buffer; every device part equals the host part (dense: its bf16 rounding). Then a
// model read through the weight store runs on the GPU exactly as from the files.
#include <gtest/gtest.h>

#include <cstring>

#include "backend/cuda/weight_uploader.h"
#include "cuda_testing.h"
#include "formats/expert_block.h"
#include "kv/state_manager.h"
#include "model/model.h"
#include "weights/weights_testing.h"

namespace bg::testing {
namespace {

struct HostWeight {
  QuantWeight w;
  std::vector<std::byte> data, scale;
};

HostWeight make_weight(WeightFormat f, DType dense_dtype, int64_t n_out, int64_t n_in, uint64_t seed) {
  HostWeight h;
  std::vector<float> v = random_floats(static_cast<size_t>(n_out * n_in), 0.5f, seed);
  HostTensor codes, scales;
  if (f == WeightFormat::kFp8Block) {
    quantize_fp8_block(v.data(), n_out, n_in, &codes, &scales);
  } else if (f == WeightFormat::kMxfp4) {
    quantize_mxfp4(v.data(), n_out, n_in, &codes, &scales);
  } else {
    codes = HostTensor(dense_dtype, {n_out, n_in});
    for (size_t i = 0; i < v.size(); ++i) {
      if (dense_dtype == DType::kF32) std::memcpy(codes.data() + 4 * i, &v[i], 4);
      else if (dense_dtype == DType::kBF16) { const uint16_t b = f32_to_bf16(v[i]); std::memcpy(codes.data() + 2 * i, &b, 2); }
      else { const uint16_t b = 0x3c00; std::memcpy(codes.data() + 2 * i, &b, 2); }  // F16 1.0
    }
  }
  h.data.assign(codes.data(), codes.data() + codes.nbytes());
  h.scale.assign(scales.data(), scales.data() + scales.nbytes());
  h.w.format = f;
  h.w.n_out = n_out;
  h.w.n_in = n_in;
  h.w.name = fmt::format("w{}", seed);
  h.w.data = TensorView{codes.dtype(), codes.shape(), h.data.data(), h.data.size(), h.w.name};
  if (!h.scale.empty()) h.w.scale = TensorView{scales.dtype(), scales.shape(), h.scale.data(), h.scale.size(), ""};
  return h;
}

// What the device part must hold.
std::vector<std::byte> expected_data(const HostWeight& h) {
  if (h.w.format != WeightFormat::kDense || h.w.data.dtype == DType::kBF16) return h.data;
  std::vector<std::byte> out(static_cast<size_t>(h.w.n_out * h.w.n_in) * 2);
  for (int64_t i = 0; i < h.w.n_out * h.w.n_in; ++i) {
    const uint16_t b = f32_to_bf16(load_as_f32(h.data.data(), h.w.data.dtype, i));
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

void expect_uploaded(const std::vector<HostWeight>& hs, const std::vector<ops::DeviceWeightStorage>& got) {
  ASSERT_EQ(hs.size(), got.size());
  for (size_t i = 0; i < hs.size(); ++i) {
    const auto want = expected_data(hs[i]);
    std::vector<std::byte> back(want.size());
    BG_CUDA_CHECK(cudaMemcpy(back.data(), got[i].desc.data, back.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(back.data(), want.data(), want.size()), 0) << "weight " << i << " data";
    if (!hs[i].scale.empty()) {
      std::vector<std::byte> s(hs[i].scale.size());
      BG_CUDA_CHECK(cudaMemcpy(s.data(), got[i].desc.scale, s.size(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(s, hs[i].scale) << "weight " << i << " scale";
    }
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got[i].desc.data) % kWeightPartAlign, 0u);
  }
}

TEST(WeightUploader, MixedBatchFromPageableAndPinnedMemory) {
  BG_REQUIRE_GPU();
  cudaStream_t stream;
  BG_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    cuda::WeightUploader up(stream);
    std::vector<HostWeight> hs;
    hs.push_back(make_weight(WeightFormat::kDense, DType::kF32, 96, 64, 1));
    hs.push_back(make_weight(WeightFormat::kDense, DType::kBF16, 33, 64, 2));
    hs.push_back(make_weight(WeightFormat::kFp8Block, DType::kU8, 200, 160, 3));
    hs.push_back(make_weight(WeightFormat::kMxfp4, DType::kU8, 64, 128, 4));
    hs.push_back(make_weight(WeightFormat::kDense, DType::kF16, 8, 32, 5));
    hs.push_back(make_weight(WeightFormat::kDense, DType::kF32, 4096, 4100, 6));  // > one 64 MiB staging window
    std::vector<const QuantWeight*> ws;
    for (auto& h : hs) ws.push_back(&h.w);
    expect_uploaded(hs, up.upload(ws, 0));
    // The same weights with their bytes pinned: the raw ones are copied straight from host memory.
    std::vector<HostRegion> regions;
    for (auto& h : hs) {
      regions.push_back({h.data.data(), h.data.size()});
      if (!h.scale.empty()) regions.push_back({h.scale.data(), h.scale.size()});
    }
    auto pinned = up.pin(regions);
    const uint64_t staged_before = up.bytes_staged();
    expect_uploaded(hs, up.upload(ws, 0));
    EXPECT_GT(up.bytes_staged(), staged_before) << "F32/F16 still convert through staging";
  }
  cudaStreamDestroy(stream);
}

// An expert batch is laid out as expert blocks: expert e's first part starts at e * block bytes.
TEST(WeightUploader, ExpertBatchIsLaidOutAsExpertBlocks) {
  BG_REQUIRE_GPU();
  cudaStream_t stream;
  BG_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    cuda::WeightUploader up(stream);
    std::vector<HostWeight> hs;
    const int n_experts = 5;
    for (int e = 0; e < n_experts; ++e) {
      hs.push_back(make_weight(WeightFormat::kMxfp4, DType::kU8, 64, 96, 10 + e));  // gate
      hs.push_back(make_weight(WeightFormat::kMxfp4, DType::kU8, 64, 96, 20 + e));  // up
      hs.push_back(make_weight(WeightFormat::kMxfp4, DType::kU8, 96, 64, 30 + e));  // down
    }
    std::vector<const QuantWeight*> ws;
    for (auto& h : hs) ws.push_back(&h.w);
    const auto got = up.upload(ws, n_experts);
    expect_uploaded(hs, got);
    std::vector<size_t> parts;
    for (int k = 0; k < 3; ++k) {
      parts.push_back(hs[static_cast<size_t>(k)].data.size());
      parts.push_back(hs[static_cast<size_t>(k)].scale.size());
    }
    const ExpertBlockLayout lay = expert_block_layout(parts);
    const auto* base = static_cast<const std::byte*>(got[0].desc.data);
    for (int e = 0; e < n_experts; ++e) {
      for (int k = 0; k < 3; ++k) {
        const auto& d = got[static_cast<size_t>(3 * e + k)].desc;
        EXPECT_EQ(static_cast<const std::byte*>(d.data) - base,
                  static_cast<ptrdiff_t>(e * lay.bytes + lay.part_offsets[2 * k]));
        EXPECT_EQ(static_cast<const std::byte*>(d.scale) - base,
                  static_cast<ptrdiff_t>(e * lay.bytes + lay.part_offsets[2 * k + 1]));
      }
    }
  }
  cudaStreamDestroy(stream);
}

// The GPU engine reading through the weight store (segments pinned, each layer's expert blocks one copy) computes
// exactly what it computes from the files (same bytes on the device, same kernels).
TEST(WeightUploader, GpuModelThroughTheStoreEqualsTheFiles) {
  BG_REQUIRE_GPU();
  for (const std::string c : {"kimi_k3/k3-tiny", "deepseek_v3/tiny-fp8"}) {
    StoreGuard g;
    const auto dir = golden_model(c);
    InProcessDaemon d(daemon_options(dir, g.name()));
    ASSERT_EQ(d.wait_ready(), "");
    auto logits = [&](const LoadOptions& o) {
      auto m = load_model(dir, o);
      auto state = make_state(*m, 1, 64);
      auto seq = state->new_sequence(64);
      const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7};
      std::vector<float> out(prompt.size() * static_cast<size_t>(m->info().vocab_size));
      m->forward(*seq, prompt, out.data());
      return out;
    };
    const auto direct = logits(load_options("", "cuda"));
    const auto stored = logits(load_options(g.name(), "cuda"));
    for (float x : direct) ASSERT_TRUE(std::isfinite(x)) << c;
    EXPECT_EQ(direct, stored) << c;
  }
}

}  // namespace
}  // namespace bg::testing

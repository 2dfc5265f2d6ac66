// The W4A16 kernel's host side for the backend: its params from the MoE layer's (with the BG_MOE_W4A16_* switches),
// and a layer's device copy (one allocation of packed expert blocks and its block table). The kernel, launcher and
// workspace are in moe_w4a16_cuda.cu.
#include <algorithm>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"

namespace bg::ops {

namespace {

// The fields every use of the kernel shares.
MoeW4a16Params moe_w4a16_common_params(const MoeCudaParams& p, int32_t fixed_splits) {
  BG_CHECK(p.expert_format == WeightFormat::kMxfp4, "moe_w4a16: experts are {}, the kernel reads MXFP4",
           weight_format_name(p.expert_format));
  MoeW4a16Params q;
  q.n_tokens = p.shape.n_tokens;
  q.top_k = p.shape.top_k;
  q.n_experts = p.shape.n_slots;
  q.hidden = p.hidden;
  q.inter = p.inter;
  q.act = p.act.kind == MoeGlu::kSitu ? MoeW4a16Act::kSiTU : MoeW4a16Act::kSwiGLU;
  q.beta = p.act.beta;
  q.beta_lin = p.act.beta_lin;
  q.out_f32 = p.out_type == MoeOutType::kF32;
  q.accumulate = p.accumulate;
  q.fixed_splits = fixed_splits;
  q.wgmma = env_switch("BG_MOE_W4A16_WGMMA", false);
  q.narrow = env_switch("BG_MOE_W4A16_NARROW", true);
  q.stream_k = env_switch("BG_MOE_W4A16_STREAM_K", true);
  q.overlap = env_switch("BG_MOE_W4A16_OVERLAP", true);
  const int combine = env_choice("BG_MOE_W4A16_COMBINE", {"auto", "fused", "separate"});
  q.combine = combine == 1   ? MoeW4a16Combine::kFused
              : combine == 2 ? MoeW4a16Combine::kSeparate
                             : MoeW4a16Combine::kAuto;
  return q;
}

}  // namespace

MoeW4a16Params moe_w4a16_params(const MoeCudaParams& p, int32_t fixed_splits) {
  BG_CHECK(p.shape.all_local, "moe_w4a16: the fused combine needs every pair on this rank (all_local routing)");
  return moe_w4a16_common_params(p, fixed_splits);
}

MoeW4a16Params moe_w4a16_rows_params(const MoeCudaParams& p, int32_t fixed_splits) {
  MoeW4a16Params q = moe_w4a16_common_params(p, fixed_splits);
  q.out_f32 = false;
  q.accumulate = false;
  q.rows_out = true;
  return q;
}

MoeW4a16DeviceLayer moe_w4a16_upload(std::span<const MoeW4a16ExpertView> experts, int64_t hidden, int64_t inter) {
  std::vector<const MoeW4a16ExpertView*> slots;
  for (const MoeW4a16ExpertView& e : experts) slots.push_back(&e);
  return moe_w4a16_upload_slots(moe_w4a16_layer_info(experts, hidden, inter), slots);
}

MoeW4a16DeviceLayer moe_w4a16_device_layer(const MoeW4a16LayoutInfo& info, const std::vector<bool>& present) {
  BG_CHECK(static_cast<int64_t>(present.size()) == info.n_slots && info.block_bytes > 0,
           "moe_w4a16_device_layer: {} slots for a layout of {} (block of {} bytes)", present.size(), info.n_slots,
           info.block_bytes);
  const auto block = static_cast<size_t>(info.block_bytes);
  const auto n_present = static_cast<size_t>(std::count(present.begin(), present.end(), true));
  MoeW4a16DeviceLayer layer;
  layer.weights.info = info;
  layer.host_table.assign(present.size(), nullptr);
  if (n_present > 0) {
    // Not zero-initialised: a K3 layer is ~1 GB, and every block is packed whole next.
    layer.storage = cuda::DeviceBuffer(n_present * block);
    size_t k = 0;
    for (size_t s = 0; s < present.size(); ++s) {
      if (present[s]) layer.host_table[s] = layer.storage.as<uint8_t>() + (k++) * block;
    }
  }
  layer.table = cuda::upload(layer.host_table);
  layer.weights.blocks = layer.table.as<const void*>();
  return layer;
}

MoeW4a16DeviceLayer moe_w4a16_upload_slots(const MoeW4a16LayoutInfo& info,
                                           std::span<const MoeW4a16ExpertView* const> slots) {
  BG_CHECK(static_cast<int64_t>(slots.size()) == info.n_slots, "moe_w4a16_upload: {} slots for a layout of {}",
           slots.size(), info.n_slots);
  std::vector<bool> present(slots.size());
  for (size_t s = 0; s < slots.size(); ++s) present[s] = slots[s] != nullptr;
  MoeW4a16DeviceLayer layer = moe_w4a16_device_layer(info, present);
  const auto block = static_cast<size_t>(info.block_bytes);
  const size_t n_present = layer.storage.bytes() / block;
  if (n_present == 0) return layer;
  // Packed on the host into one buffer (moe_w4a16_pack_expert writes every byte), then one upload.
  const auto host = std::make_unique_for_overwrite<std::byte[]>(n_present * block);
  size_t k = 0;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] == nullptr) continue;
    const std::span<std::byte> dst(host.get() + k * block, block);
    moe_w4a16_pack_expert(info, *slots[s], static_cast<int64_t>(s), dst);
    ++k;
  }
  BG_CUDA_CHECK(cudaMemcpy(layer.storage.data(), host.get(), n_present * block, cudaMemcpyHostToDevice));
  return layer;
}

cuda::DeviceBuffer moe_w4a16_block_table(const void* base, const MoeW4a16LayoutInfo& info) {
  BG_CHECK(base != nullptr && cuda::aligned_to(base, 256), "moe_w4a16_block_table: base {} must be 256-byte aligned",
           base);
  std::vector<const void*> ptrs(static_cast<size_t>(info.n_slots));
  for (int64_t s = 0; s < info.n_slots; ++s) {
    ptrs[static_cast<size_t>(s)] = static_cast<const uint8_t*>(base) + s * info.block_bytes;
  }
  return cuda::upload(ptrs);
}

}  // namespace bg::ops

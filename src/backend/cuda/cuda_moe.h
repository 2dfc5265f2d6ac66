// The CUDA backend's MoE half: linear handles (device descriptor + the host view they came from), expert weights by
// slot (the descriptor array every MoE kernel reads, and for MXFP4 experts the W4A16 decode layout of the whole
// layer), and the MoE stage ops over backend tensors. CudaBackend forwards its MoE methods here.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_allocator.h"
#include "ops/linear/linear_cuda.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe_w4a16/moe_w4a16_cuda.h"

namespace bg::cuda {

class CudaLinear final : public LinearHandle {
 public:
  CudaLinear(ops::DeviceWeightStorage s, const QuantWeight& host) : s_(std::move(s)), host_(host) {}
  int64_t n_out() const override { return s_.desc.n_out; }
  int64_t n_in() const override { return s_.desc.n_in; }
  const ops::DeviceWeight& desc() const { return s_.desc; }
  // The host view it was uploaded from (views into the checkpoint's mapping or the weight store, alive with the model).
  const QuantWeight& host() const { return host_; }

 private:
  ops::DeviceWeightStorage s_;
  QuantWeight host_;
};

inline const CudaLinear& cuda_linear(const LinearHandle& h) { return static_cast<const CudaLinear&>(h); }

// Expert weights by slot: the device descriptor array (uploaded when prepared, so graph capture never uploads), its
// host mirror, and — when every slot is MXFP4 with widths the decode kernel takes — the layer's W4A16 layout.
class CudaExpertSlots final : public ExpertSlots {
 public:
  explicit CudaExpertSlots(const ExpertWeights& by_slot);
  int64_t n_slots() const override { return static_cast<int64_t>(host_.size()); }
  const ops::ExpertWeightsCuda* device() const { return dev_.as<ops::ExpertWeightsCuda>(); }
  const ops::DeviceWeight& gate0() const { return host_[0].gate; }
  const ops::MoeW4a16Weights* w4a16() const { return w4a16_ ? &w4a16_->weights : nullptr; }
  // Rewrites one slot in stream order (the W4A16 layout is re-packed from the slots' host views).
  void set(int64_t slot, const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down,
           cudaStream_t stream);

 private:
  void pack_w4a16();

  std::vector<ops::ExpertWeightsCuda> host_;
  std::vector<ops::MoeW4a16ExpertView> views_;
  DeviceBuffer dev_;
  std::optional<ops::MoeW4a16DeviceLayer> w4a16_;
};

// What the MoE stage ops need from the backend.
struct MoeContext {
  CachingAllocator* alloc = nullptr;
  int32_t* error_flags = nullptr;  // the backend's device error word
  cudaStream_t stream = nullptr;
  // Batch invariance (BackendOptions::deterministic): where the layer has the W4A16 layout, the fused kernel runs
  // for every row count (the kernel choice would otherwise depend on rows per expert) with a fixed split-K factor.
  bool deterministic = false;
};

void moe_dispatch(const MoeContext& c, const Tensor& slot_map, const Tensor& ids, const Tensor& weights,
                  MoeRouting& r);
void moe_gather(const MoeContext& c, const MoeRouting& r, const Tensor& x, Tensor& rows);
void moe_experts(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu, const MoeRouting& r,
                 const Tensor& rows, Tensor& y_rows);
void moe_combine(const MoeContext& c, const MoeRouting& r, const Tensor& y_rows, Tensor& out);
// Gather + experts + combine of an all-local routing: the fused W4A16 decode kernel where it applies (MXFP4 slots,
// few rows per expert), the three stage kernels otherwise. Returns which ran (for logs and tests).
enum class MoeLocalPath : uint8_t { kW4a16, kStages };
MoeLocalPath moe_routed_local(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu,
                              const MoeRouting& r, const Tensor& x, Tensor& out);

}  // namespace bg::cuda

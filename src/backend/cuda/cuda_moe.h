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
#include "ops/moe/moe_grouped_cuda.h"
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

// The grouped prefill path's bf16 expert-weight scratch (ops/moe/moe_grouped.h): one per backend, i.e. per device,
// shared by every MoE layer of every step, taken from the backend's caching allocator (so it counts against the
// memory budget). Sized by ensure() for one group of the layer's shape (at most kMoeGroupedScratchBudgetBytes); all
// MoE layers of a model share that shape, so it is allocated once, at the first prefill step that takes the path,
// and kept until the backend goes. Only the backend's stream uses it; ensure() runs after the path's stream
// synchronisation, so a regrowth never releases memory a queued kernel still reads.
class MoeGroupedScratch {
 public:
  // Grows to at least `bytes` (contents not kept) and returns the buffer.
  void* ensure(CachingAllocator& alloc, size_t bytes);
  size_t bytes() const { return bytes_; }
  void reset() {
    mem_.reset();
    bytes_ = 0;
  }

 private:
  std::shared_ptr<void> mem_;
  size_t bytes_ = 0;
};

// What the MoE stage ops need from the backend.
struct MoeContext {
  CachingAllocator* alloc = nullptr;
  int32_t* error_flags = nullptr;  // the backend's device error word
  cudaStream_t stream = nullptr;
  // Batch invariance (BackendOptions::deterministic): where the layer has the W4A16 layout, the fused kernel runs
  // for every row count (the kernel choice would otherwise depend on rows per expert) with a fixed split-K factor.
  bool deterministic = false;
  // The grouped prefill path (moe_experts): its scratch and the backend's cuBLAS handle and workspace. A null scratch
  // or handle leaves the tiled kernel as the only prefill path.
  MoeGroupedScratch* grouped_scratch = nullptr;
  ops::MoeGroupedContext blas;
};

// Count of expert FFN calls that took the grouped prefill path, process-wide (tests check that a prefill routed
// through it).
uint64_t moe_grouped_calls();

void moe_dispatch(const MoeContext& c, const Tensor& slot_map, const Tensor& ids, const Tensor& weights,
                  MoeRouting& r);
void moe_gather(const MoeContext& c, const MoeRouting& r, const Tensor& x, Tensor& rows);
// The expert FFN over the gathered rows: the grouped prefill path (dequantize the touched experts once, cuBLAS grouped
// GEMMs) when c has its resources, the stream is not capturing and the expected rows per expert reach
// BG_MOE_GROUPED_MIN_ROWS (default ops::kMoeGroupedMinRowsDefault); the skinny / tiled kernels otherwise.
void moe_experts(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu, const MoeRouting& r,
                 const Tensor& rows, Tensor& y_rows);
void moe_combine(const MoeContext& c, const MoeRouting& r, const Tensor& y_rows, Tensor& out);
// Gather + experts + combine of an all-local routing: the fused W4A16 decode kernel where it applies (MXFP4 slots,
// few rows per expert), the three stage kernels otherwise. Returns which ran (for logs and tests).
enum class MoeLocalPath : uint8_t { kW4a16, kStages };
MoeLocalPath moe_routed_local(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu,
                              const MoeRouting& r, const Tensor& x, Tensor& out);

}  // namespace bg::cuda

// The CUDA backend's MoE half: linear handles (device descriptor + the host view they came from), expert weights by
// slot (the descriptor array every MoE kernel reads, and for MXFP4 experts the W4A16 decode layout of the whole
// layer), and the MoE stage ops over backend tensors. CudaBackend forwards its MoE methods here.
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_allocator.h"
#include "backend/cuda/weight_uploader.h"
#include "ops/linear/linear_cuda.h"
#include "ops/moe/moe_cuda.h"
#include "ops/moe/moe_fp8_cuda.h"
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

// BG_MOE_W4A16=0 keeps MXFP4 experts in the checkpoint's format on the device (the stage kernels run, not the W4A16
// kernel): for triage and for comparisons that need the stage kernels' arithmetic on both sides. Read at load (when
// a layer's experts are prepared), so it must be set before the model loads.
bool moe_w4a16_wanted();
// BG_MOE_W4A16_PACK=host|device: where a layer's resident MXFP4 experts are packed into the W4A16 layout at load.
// device (the default): their checkpoint bytes go up through the weight uploader (pinned) and the device packs them
// (CudaExpertSlots::pack_on_device; the slice's warm restart 3.45 -> 2.12 s on the H200); host: on the host, then one
// pageable upload. Read at load.
bool moe_w4a16_device_pack_wanted();
// A weight store's W4A16 expert blocks (experts bound deferred) go to the device as they are
// (CudaExpertSlots::upload_blocks, and streamed ones into their pool buffer's block); BG_STORE_W4A16_DIRECT=0 unpacks
// them and packs the layer as from the files. Read at load.
bool store_blocks_direct_wanted();
// Whether the W4A16 layout can hold these expert weights (MXFP4, widths in multiples of 32).
bool w4a16_packable(std::span<const QuantWeight* const> weights);

// Expert weights by slot. A layer of MXFP4 experts the W4A16 kernel takes lives in its layout only (prepare_linears
// left the experts on the host; one block per expert, found through the layout's block table): every MoE path reads
// that copy (the fused kernel at decode, with the fused combine on one rank or rows in / rows out behind an exchange;
// the grouped prefill path dequantizes from it). In a streamed layer the resident slots' blocks are packed at load and
// a streamed slot's entry is pointed (set) at the block its pool buffer was laid out into (lay_out, on the device).
// Any other layer keeps per-slot device copies and their descriptor array (uploaded when prepared, so graph capture
// never uploads; rewritten in place by set), which the stage kernels read.
class CudaExpertSlots final : public ExpertSlots {
 public:
  CudaExpertSlots(const ExpertWeights& by_slot, WeightUploader& uploader);
  int64_t n_slots() const override { return static_cast<int64_t>(host_.size()); }
  // The descriptor array (device); its data pointers are null for a layer in the W4A16 layout (stages() false).
  const ops::ExpertWeightsCuda* device() const { return dev_.as<ops::ExpertWeightsCuda>(); }
  // Format and shape of the layer's experts (data pointers may be null, see device()).
  const ops::DeviceWeight& gate0() const { return host_[0].gate; }
  // Host copies of the slots' descriptors (the FP8 prefill path passes FP8-block experts' pointers to cuBLASLt).
  std::span<const ops::ExpertWeightsCuda> host() const { return host_; }
  const ops::MoeW4a16Weights* w4a16() const { return w4a16_ ? &w4a16_->weights : nullptr; }
  // Whether every slot has a device copy in the checkpoint's format (the stage kernels can run).
  bool stages() const { return stages_; }
  // Bytes of one expert's W4A16 block (0 without the layout).
  size_t layout_bytes() const { return w4a16_ ? static_cast<size_t>(w4a16_->weights.info.block_bytes) : 0; }
  // Whether a weight store's W4A16 block (scale shifts 0, this build's layout version) is this layer's block byte for
  // byte, so a streamed expert's block is copied as it is (Backend::expert_layout_takes_blocks).
  bool takes_blocks() const;
  // Packs the expert in gate / up / down (device copies in the checkpoint's format) into dst with this layer's scale
  // shifts, on `stream`.
  void lay_out(const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down, Tensor& dst,
               int32_t* error_flags, cudaStream_t stream) const;
  // Rewrites one slot in stream order: its descriptor, and with the layout its block pointer (laid_out: the block
  // lay_out wrote for this expert, required then).
  void set(int64_t slot, const LinearHandle& gate, const LinearHandle& up, const LinearHandle& down,
           const Tensor* laid_out, cudaStream_t stream);

 private:
  // Bytes of checkpoint-format experts staged on the device at a time when the device packs a layer
  // (BG_MOE_W4A16_PACK_CHUNK_BYTES overrides it; tests use a small one to pack in several chunks).
  static constexpr size_t kDevicePackChunkBytes = size_t{512} << 20;

  void upload_deferred(WeightUploader& uploader);
  void pack(const ExpertWeights& by_slot, WeightUploader& uploader);
  // Every present slot's W4A16 block straight from the weight store into the layer's allocation (no pack).
  void upload_blocks(const ops::MoeW4a16LayoutInfo& info, std::span<const ops::MoeW4a16ExpertView* const> present,
                     WeightUploader& uploader);
  // The checkpoint bytes of an expert bound deferred (QuantWeight::resolved), kept here for the layer's lifetime.
  const QuantWeight* resolved(const QuantWeight* w);
  void pack_on_device(const ops::MoeW4a16LayoutInfo& info, std::span<const ops::MoeW4a16ExpertView* const> present,
                      WeightUploader& uploader);

  std::vector<ops::ExpertWeightsCuda> host_;
  std::vector<ops::MoeW4a16ExpertView> views_;
  std::vector<ops::DeviceWeightStorage> uploaded_;  // slots prepare_linears left on the host, when not packed
  DeviceBuffer dev_;
  std::optional<ops::MoeW4a16DeviceLayer> w4a16_;
  bool stages_ = false;
  std::deque<QuantWeight> resolved_;  // stable addresses: views_ point into it
  std::unordered_map<const QuantWeight*, const QuantWeight*> resolved_of_;  // deferred weight -> its entry there
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
  // The FP8 prefill path's cuBLASLt handle and kept algorithms (created at its first call).
  ops::MoeFp8Gemm& fp8_gemm();
  void reset() {
    mem_.reset();
    bytes_ = 0;
    fp8_gemm_.reset();
  }

 private:
  std::shared_ptr<void> mem_;
  size_t bytes_ = 0;
  std::unique_ptr<ops::MoeFp8Gemm> fp8_gemm_;
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
// The same for the W4A16 prefill kernel (by default at 32 to 511 rows per expert; BG_MOE_PREFILL).
uint64_t moe_w4a16_prefill_calls();
// The same for the FP8 prefill path (BG_MOE_PREFILL=fp8 only).
uint64_t moe_fp8_prefill_calls();

// live_tokens (device, nullable) and live_row0: the padding rows to drop (ops::MoeWorkspace::live_tokens).
void moe_dispatch(const MoeContext& c, const Tensor& slot_map, const Tensor& ids, const Tensor& weights,
                  MoeRouting& r, const int32_t* live_tokens, int64_t live_row0);
void moe_gather(const MoeContext& c, const MoeRouting& r, const Tensor& x, Tensor& rows);
// The expert FFN over the gathered rows: the grouped prefill path (dequantize the touched experts once, cuBLAS grouped
// GEMMs) when c has its resources, the stream is not capturing and the expected rows per expert reach
// BG_MOE_GROUPED_MIN_ROWS (default ops::kMoeGroupedMinRowsDefault, or kMoeGroupedMinRowsW4a16 for a layer in the
// W4A16 layout); else the W4A16 kernel with rows out for such a layer, the skinny / tiled kernels for the others.
void moe_experts(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu, const MoeRouting& r,
                 const Tensor& rows, Tensor& y_rows);
// out[t] (+)= sum_k w y_rows[row of (t, k)]: with `accumulate` false every row is written (zero without pairs).
void moe_combine(const MoeContext& c, const MoeRouting& r, const Tensor& y_rows, Tensor& out, bool accumulate = true);
// Gather + experts + combine of an all-local routing: the fused W4A16 kernel where the layer has the layout (unless
// a prefill path takes the call: the W4A16 prefill kernel with the gather fused, then the combine, or the grouped
// path inside the stages), the three stage kernels otherwise. `accumulate` as Backend::moe_routed_local's. Returns
// which ran (logs and tests).
enum class MoeLocalPath : uint8_t { kW4a16, kW4a16Prefill, kStages };
MoeLocalPath moe_routed_local(const MoeContext& c, const CudaExpertSlots& slots, const GluSpec& glu,
                              const MoeRouting& r, const Tensor& x, Tensor& out, bool accumulate);

}  // namespace bg::cuda

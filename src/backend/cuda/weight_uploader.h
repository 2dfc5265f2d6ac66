// Load-time upload of weights in batches, one device allocation per batch (no per-weight cudaMalloc, no rounding of
// every small weight up to the allocator's granularity). Bytes in pinned host memory (the weight store's segments,
// registered by pin()) are copied straight from there, adjacent weights in one copy; everything else (pageable
// checkpoint mappings, dense F32/F16 rounded to bf16 on the way) goes through a double-buffered pinned staging buffer
// that mirrors a window of the batch's allocation, one copy per window. Synchronous per batch, on the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "formats/weight_source.h"
#include "ops/linear/linear_cuda.h"

namespace bg::cuda {

class WeightUploader {
 public:
  explicit WeightUploader(cudaStream_t stream);
  ~WeightUploader();
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;

  // cudaHostRegister (read-only, portable) of each region; the handle unregisters them. A region that cannot be
  // registered is logged with CUDA's reason (its weights then go through the staging buffer).
  std::shared_ptr<void> pin(std::span<const HostRegion> regions);
  // n_experts > 0: the weights are n_experts equal runs (one layer's experts), each laid out as one expert block
  // (formats/expert_block.h) in device memory, so a store's expert blocks copy as one contiguous run. Otherwise each
  // part starts 256-byte aligned, except that the weights of each of `glued` follow each other with no gap (the
  // caller checks they are dense with one n_in: together they are one [sum of n_out, n_in] weight).
  std::vector<ops::DeviceWeightStorage> upload(std::span<const QuantWeight* const> weights, int64_t n_experts,
                                               std::span<const LinearRun> glued = {});
  // Raw bytes to device memory: each region to `device` + its offset (pinned regions copied straight, the others
  // through the staging buffer). Synchronous, on the uploader's stream. For a weight store's W4A16 expert blocks.
  struct RawCopy {
    HostRegion src;
    size_t dst = 0;
  };
  void copy_bytes(std::span<const RawCopy> copies, std::byte* device);
  cudaStream_t stream() const { return stream_; }
  uint64_t bytes_uploaded() const { return bytes_uploaded_; }
  uint64_t bytes_staged() const { return bytes_staged_; }

  struct Registry;
  struct Op;

 private:
  void copy_pinned(std::vector<Op>& ops, std::byte* device);
  void copy_staged(std::vector<Op>& ops, std::byte* device);
  // Sorts `all` by destination, merges adjacent direct copies, then issues the staged ones and the direct ones.
  void copy_all(std::vector<Op>& all, std::byte* device);

  cudaStream_t stream_;
  std::shared_ptr<Registry> registry_;
  std::byte* staging_[2] = {nullptr, nullptr};
  cudaEvent_t staged_[2] = {nullptr, nullptr};
  uint64_t bytes_uploaded_ = 0;
  uint64_t bytes_staged_ = 0;
};

}  // namespace bg::cuda

// StepSampler: one step's sampling on the CUDA backend. The rows go up from pinned memory, sample_rows_cuda runs on
// the compute stream after the step's kernels (the logits never leave the device), and the results come back with the
// step's kernel error flags in one device -> host copy into pinned memory. Owned by the CudaBackend; used only from
// the thread that drives the backend (the worker's loop thread), one step at a time.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "backend/cuda/device_buffer.h"
#include "backend/tensor.h"
#include "ops/sampling/sampling.h"

namespace bg::cuda {

class StepSampler {
 public:
  StepSampler() = default;
  ~StepSampler();
  StepSampler(const StepSampler&) = delete;
  StepSampler& operator=(const StepSampler&) = delete;

  // out[i] for rows[i] over logits F32 [n_rows, vocab] (device), after every op issued on `stream` so far;
  // synchronises `stream`. Returns the int32 kernel error flags at `device_errors` as the step left them (0: none);
  // `out` is filled only when they are 0.
  int32_t run(const Tensor& logits, std::span<const ops::RowSampling> rows, std::span<ops::RowSample> out,
              const int32_t* device_errors, cudaStream_t stream);

 private:
  // Pinned and device buffers of one layout: [RowSampling x capacity][flags, 16 bytes][RowSample x capacity].
  void reserve(size_t n_rows);
  size_t results_offset() const;

  std::byte* host_ = nullptr;  // pinned (cudaMallocHost)
  DeviceBuffer device_;
  DeviceBuffer workspace_;  // sample_rows_cuda's scratch, grown to the largest step seen (~95 KB per row)
  size_t capacity_rows_ = 0;
};

}  // namespace bg::cuda

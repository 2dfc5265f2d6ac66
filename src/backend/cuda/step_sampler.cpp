// StepSampler: pinned staging, one upload of the rows, sample_rows_cuda (with its device workspace), one download of
// flags + results.
#include "backend/cuda/step_sampler.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "ops/sampling/sampling_cuda.h"

namespace bg::cuda {

namespace {
constexpr size_t kFlagsBytes = 16;  // int32 flags, padded so the results stay 16-byte aligned
size_t align16(size_t n) { return (n + 15) / 16 * 16; }
}  // namespace

StepSampler::~StepSampler() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

size_t StepSampler::results_offset() const { return align16(capacity_rows_ * sizeof(ops::RowSampling)); }

void StepSampler::reserve(size_t n_rows) {
  if (n_rows <= capacity_rows_ && host_ != nullptr) return;
  if (host_ != nullptr) BG_CUDA_CHECK(cudaFreeHost(host_));
  host_ = nullptr;
  capacity_rows_ = std::max<size_t>(n_rows, 256);  // a decode batch of 256 without regrowing
  const size_t bytes = results_offset() + kFlagsBytes + capacity_rows_ * sizeof(ops::RowSample);
  void* host = nullptr;
  BG_CUDA_CHECK(cudaMallocHost(&host, bytes));
  host_ = static_cast<std::byte*>(host);
  device_ = DeviceBuffer(bytes);
}

int32_t StepSampler::run(const Tensor& logits, std::span<const ops::RowSampling> rows, std::span<ops::RowSample> out,
                         const int32_t* device_errors, cudaStream_t stream) {
  BG_CHECK(out.size() == rows.size(), "cuda sampling: {} results for {} rows", out.size(), rows.size());
  BG_CHECK(logits.dtype == DType::kF32 && logits.device == DeviceKind::kCuda && logits.shape.size() == 2,
           "cuda sampling: logits must be F32 [n_rows, vocab] in device memory");
  ops::check_row_sampling(rows, logits.rows(), logits.cols());
  reserve(rows.size());
  // The previous run synchronised, so nothing still reads or writes the pinned buffer.
  const size_t in_bytes = rows.size() * sizeof(ops::RowSampling);
  std::byte* dev = static_cast<std::byte*>(device_.data());
  if (in_bytes > 0) {
    std::memcpy(host_, rows.data(), in_bytes);
    BG_CUDA_CHECK(cudaMemcpyAsync(dev, host_, in_bytes, cudaMemcpyHostToDevice, stream));
  }
  std::byte* dev_flags = dev + results_offset();
  auto* dev_results = reinterpret_cast<ops::RowSample*>(dev_flags + kFlagsBytes);
  const ops::SamplingBatch batch{static_cast<int64_t>(rows.size()), logits.cols()};
  const size_t scratch = ops::sample_rows_workspace_bytes(batch);
  if (scratch > workspace_.bytes()) workspace_ = DeviceBuffer(std::max(scratch, workspace_.bytes() * 2));
  ops::sample_rows_cuda(batch, reinterpret_cast<ops::RowSampling*>(dev), logits.as<float>(), dev_results,
                        workspace_.data(), workspace_.bytes(), stream);
  BG_CUDA_CHECK(cudaMemcpyAsync(dev_flags, device_errors, sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  const size_t out_bytes = kFlagsBytes + rows.size() * sizeof(ops::RowSample);
  std::byte* host_flags = host_ + results_offset();
  BG_CUDA_CHECK(cudaMemcpyAsync(host_flags, dev_flags, out_bytes, cudaMemcpyDeviceToHost, stream));
  BG_CUDA_CHECK(cudaStreamSynchronize(stream));
  int32_t flags = 0;
  std::memcpy(&flags, host_flags, sizeof(flags));
  if (flags == 0 && !out.empty()) std::memcpy(out.data(), host_flags + kFlagsBytes, out.size() * sizeof(ops::RowSample));
  return flags;
}

}  // namespace bg::cuda

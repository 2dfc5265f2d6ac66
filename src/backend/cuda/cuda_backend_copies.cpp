// CudaBackend (cuda_backend_impl.h): the host tier's pinned memory and its copies on a second stream.
#include "backend/cuda/cuda_backend_impl.h"

namespace bg::cuda_backend_detail {

// ---- host tier ----------------------------------------------------------------------------------------------------
std::shared_ptr<std::byte> CudaBackend::alloc_host(size_t bytes) {
  void* p = nullptr;
  BG_CUDA_CHECK(cudaMallocHost(&p, std::max<size_t>(bytes, 1)));
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [](std::byte* q) { cudaFreeHost(q); });
}

// One batch: the copy stream first waits for everything issued on the compute stream so far (a device -> host copy
// reads what the last step wrote), then copies, then records the batch's event.
CopyFence CudaBackend::issue_copies(std::span<const HostCopy> copies, cudaMemcpyKind kind) {
  BG_CHECK(!capturing_, "cuda backend: host-tier copies during graph capture");
  if (copy_stream_ == nullptr) {
    BG_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    BG_CUDA_CHECK(cudaEventCreateWithFlags(&copy_after_, cudaEventDisableTiming));
  }
  retire_copies();
  BG_CUDA_CHECK(cudaEventRecord(copy_after_, stream_));
  BG_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, copy_after_, 0));
  for (const HostCopy& c : copies) {
    BG_CHECK(c.device.device == DeviceKind::kCuda && c.device_offset + c.bytes <= c.device.nbytes(),
             "cuda backend: host copy of bytes [{}, {}) outside a device tensor of {}", c.device_offset,
             c.device_offset + c.bytes, c.device.nbytes());
    std::byte* dev = static_cast<std::byte*>(c.device.data) + c.device_offset;
    if (kind == cudaMemcpyDeviceToHost) {
      BG_CUDA_CHECK(cudaMemcpyAsync(c.host, dev, c.bytes, kind, copy_stream_));
    } else {
      BG_CUDA_CHECK(cudaMemcpyAsync(dev, c.host, c.bytes, kind, copy_stream_));
    }
  }
  return record_copy_fence(copy_stream_);
}

CopyFence CudaBackend::record_copy_fence(cudaStream_t stream) {
  cudaEvent_t done = nullptr;
  if (spare_copy_events_.empty()) {
    BG_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  } else {
    done = spare_copy_events_.back();
    spare_copy_events_.pop_back();
  }
  BG_CUDA_CHECK(cudaEventRecord(done, stream));
  copies_in_flight_.emplace_back(++copies_issued_, done);
  return copies_issued_;
}

// A prefetched expert's W4A16 block, packed on the copy stream right after its copies: the compute stream meets it
// only through compute_wait of the returned fence (the buffer's readers of earlier layers were ordered before those
// copies by issue_copies). The copy stream's next copies wait for it (a third stream would let them go on: not done).
CopyFence CudaBackend::lay_out_expert_ahead(const ExpertSlots& slots, const LinearHandle& gate, const LinearHandle& up,
                                            const LinearHandle& down, Tensor& dst) {
  BG_CHECK(copy_stream_ != nullptr, "cuda backend: an expert laid out ahead before any copy");
  static_cast<const cuda::CudaExpertSlots&>(slots).lay_out(gate, up, down, dst, errors_.as<int32_t>(), copy_stream_);
  return record_copy_fence(copy_stream_);
}

void CudaBackend::retire_copies() {
  while (!copies_in_flight_.empty()) {
    const cudaError_t err = cudaEventQuery(copies_in_flight_.front().second);
    if (err == cudaErrorNotReady) return;
    BG_CUDA_CHECK(err);
    copies_done_ = copies_in_flight_.front().first;
    spare_copy_events_.push_back(copies_in_flight_.front().second);
    copies_in_flight_.pop_front();
  }
}

cudaEvent_t CudaBackend::fence_event(CopyFence fence) const {
  for (const auto& [f, ev] : copies_in_flight_) {
    if (f == fence) return ev;
  }
  fail("cuda backend: copy fence {} is not in flight", fence);
}

bool CudaBackend::fence_done(CopyFence fence) {
  retire_copies();
  return fence <= copies_done_;
}

void CudaBackend::wait_fence(CopyFence fence) {
  if (fence_done(fence)) return;
  BG_CUDA_CHECK(cudaEventSynchronize(fence_event(fence)));
  retire_copies();
}

void CudaBackend::compute_wait(CopyFence fence) {
  BG_CHECK(!capturing_, "cuda backend: waiting for a host-tier copy during graph capture");
  if (fence_done(fence)) return;
  BG_CUDA_CHECK(cudaStreamWaitEvent(stream_, fence_event(fence), 0));
}

}  // namespace bg::cuda_backend_detail

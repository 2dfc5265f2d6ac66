// DeviceBuffer: cudaMalloc/cudaFree with checks.
#include "backend/cuda/device_buffer.h"

#include <utility>

namespace bg::cuda {

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) BG_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::fill_bytes(int value) {
  if (bytes_ > 0) BG_CUDA_CHECK(cudaMemset(ptr_, value, bytes_));
}

DeviceBuffer upload_bytes(const void* host, size_t bytes) {
  DeviceBuffer buf(bytes);
  if (bytes > 0) BG_CUDA_CHECK(cudaMemcpy(buf.data(), host, bytes, cudaMemcpyHostToDevice));
  return buf;
}

void download_bytes(const DeviceBuffer& buf, void* host, size_t bytes) {
  BG_CHECK(bytes <= buf.bytes(), "download of {} bytes from a {} byte buffer", bytes, buf.bytes());
  if (bytes > 0) BG_CUDA_CHECK(cudaMemcpy(host, buf.data(), bytes, cudaMemcpyDeviceToHost));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

}  // namespace bg::cuda

// An owning device allocation (RAII) and typed upload/download helpers for tests and weight upload.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace bg::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  // Fills every byte with `value` (0xff poisons floats as NaN).
  void fill_bytes(int value);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Copies host data into a new device buffer / a device buffer into a host vector (synchronous).
DeviceBuffer upload_bytes(const void* host, size_t bytes);
void download_bytes(const DeviceBuffer& buf, void* host, size_t bytes);

template <typename T>
DeviceBuffer upload(const std::vector<T>& host) {
  return upload_bytes(host.data(), host.size() * sizeof(T));
}

template <typename T>
std::vector<T> download(const DeviceBuffer& buf, size_t count) {
  std::vector<T> out(count);
  download_bytes(buf, out.data(), count * sizeof(T));
  return out;
}

// Number of visible CUDA devices (0 when there is no driver or GPU; never throws).
int device_count();

}  // namespace bg::cuda

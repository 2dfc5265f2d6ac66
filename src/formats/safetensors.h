// safetensors: a validating header parser, a memory-mapped single-file reader, and a writer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace bg {

// One header entry; offsets are absolute within the file.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t file_offset = 0;
  uint64_t nbytes = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + header length
  std::vector<SafetensorsEntry> entries;  // in header order
  std::map<std::string, std::string> metadata;
};

// Parses and validates a header against a file of `file_size` bytes: JSON shape, dtype names, shapes, offsets inside
// the buffer, no overlap, no holes, sizes equal to shape x dtype. `bytes` must hold at least the first 8 bytes and the
// header (the caller reads them). `what` names the file in errors. Throws bg::Error.
SafetensorsHeader parse_safetensors_header(std::span<const std::byte> bytes, uint64_t file_size,
                                           const std::string& what);

// Maximum header length accepted (the format's own limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A read-only memory-mapped safetensors file.
class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  // The whole file as mapped (read-only).
  std::span<const std::byte> mapping() const { return {static_cast<const std::byte*>(map_), map_bytes_}; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws naming the file if the tensor is absent.
  TensorView view(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
};

// A tensor to write: a view plus its name.
struct NamedTensor {
  std::string name;
  TensorView view;
};

// Writes a safetensors file (header padded to 8 bytes, tensors in the given order). Throws on I/O errors.
void write_safetensors(const std::filesystem::path& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace bg

// A checkpoint directory: one model.safetensors, or shards listed by model.safetensors.index.json; all mmap'd.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/safetensors.h"

namespace bg {

class Checkpoint {
 public:
  // Opens `dir` (or a single .safetensors file). With an index, every mapped tensor must exist in its shard and every
  // shard tensor must be in the index. Throws bg::Error naming the file and tensor.
  static std::unique_ptr<Checkpoint> open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  std::optional<TensorView> find(const std::string& name) const;
  // Throws "checkpoint <dir>: missing tensor '<name>'" if absent.
  TensorView get(const std::string& name) const;
  // The shard file holding `name` (for messages).
  std::string file_of(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
};

}  // namespace bg

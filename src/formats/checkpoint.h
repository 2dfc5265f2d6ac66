// A checkpoint directory: one model.safetensors, or shards listed by model.safetensors.index.json; all mmap'd.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "formats/weight_source.h"

namespace bg {

class Checkpoint final : public WeightSource {
 public:
  // Opens `dir` (or a single .safetensors file). With an index, every mapped tensor must exist in its shard and every
  // shard tensor must be in the index. Throws bg::Error naming the file and tensor.
  static std::unique_ptr<Checkpoint> open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  std::string describe() const override { return "checkpoint " + dir_.string(); }
  bool contains(const std::string& name) const override { return where_.count(name) != 0; }
  std::optional<TensorView> find(const std::string& name) const override;
  // The shard file holding `name` (for messages).
  std::string file_of(const std::string& name) const override;
  std::vector<std::string> names() const override;
  // The opened shard files in index order (the weight store reads their headers and bytes directly).
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
};

}  // namespace bg

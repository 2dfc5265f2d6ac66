// Checkpoint: resolves the shard index, opens every shard and cross-checks index against headers.
#include "formats/checkpoint.h"

#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "core/error.h"
#include "formats/json_fields.h"

namespace bg {
namespace {

using json = nlohmann::json;

// A shard name from an index must be a plain file name inside the checkpoint directory. (A NUL would cut the name
// at the OS boundary and open a different file; it is shown escaped so the message is not cut too.)
void check_shard_name(const std::string& shard, const std::filesystem::path& index_path) {
  if (!shard.empty() && shard.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos && shard != "." &&
      shard != "..") {
    return;
  }
  std::string shown;
  for (char c : shard) {
    auto u = static_cast<unsigned char>(c);
    shown += u < 0x20 ? fmt::format("\\x{:02x}", u) : std::string(1, c);
  }
  fail("{}: shard name '{}' is not a plain file name", index_path.string(), shown);
}

}  // namespace

std::unique_ptr<Checkpoint> Checkpoint::open(const std::filesystem::path& dir) {
  auto ckpt = std::unique_ptr<Checkpoint>(new Checkpoint());
  ckpt->dir_ = dir;
  BG_CHECK(std::filesystem::exists(dir), "checkpoint path '{}' does not exist", dir.string());
  if (std::filesystem::is_regular_file(dir)) {
    ckpt->files_.push_back(SafetensorsFile::open(dir));
    for (const auto& e : ckpt->files_[0]->header().entries) ckpt->where_[e.name] = 0;
    return ckpt;
  }
  auto index_path = dir / "model.safetensors.index.json";
  if (!std::filesystem::exists(index_path)) {
    auto single = dir / "model.safetensors";
    BG_CHECK(std::filesystem::exists(single), "checkpoint '{}' has neither model.safetensors.index.json nor "
             "model.safetensors", dir.string());
    ckpt->files_.push_back(SafetensorsFile::open(single));
    for (const auto& e : ckpt->files_[0]->header().entries) ckpt->where_[e.name] = 0;
    return ckpt;
  }
  json index = read_json_file(index_path);
  BG_CHECK(index.is_object(), "{}: not a JSON object", index_path.string());
  BG_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), "{}: missing object 'weight_map'",
           index_path.string());
  std::map<std::string, size_t> shard_idx;
  std::map<std::string, std::string> mapped;
  for (const auto& [name, shard_j] : index["weight_map"].items()) {
    BG_CHECK(shard_j.is_string(), "{}: weight_map['{}'] is not a string", index_path.string(), name);
    std::string shard = shard_j.get<std::string>();
    check_shard_name(shard, index_path);
    if (!shard_idx.count(shard)) {
      shard_idx[shard] = ckpt->files_.size();
      ckpt->files_.push_back(SafetensorsFile::open(dir / shard));
    }
    mapped[name] = shard;
  }
  for (const auto& [name, shard] : mapped) {
    size_t fi = shard_idx[shard];
    BG_CHECK(ckpt->files_[fi]->contains(name), "{}: index maps '{}' to {}, which does not hold it",
             index_path.string(), name, shard);
    ckpt->where_[name] = fi;
  }
  // Every shard tensor must be listed, and listed for this shard: a copy in a second shard would be silently ignored.
  for (const auto& [shard, fi] : shard_idx) {
    const auto& f = ckpt->files_[fi];
    for (const auto& e : f->header().entries) {
      auto it = mapped.find(e.name);
      BG_CHECK(it != mapped.end(), "{}: tensor '{}' is not listed in {}", f->path().string(), e.name,
               index_path.filename().string());
      BG_CHECK(it->second == shard, "{}: tensor '{}' is also stored in {}, but the index maps it to {}",
               index_path.string(), e.name, shard, it->second);
    }
  }
  return ckpt;
}

std::optional<TensorView> Checkpoint::find(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) return std::nullopt;
  return files_[it->second]->view(name);
}

std::string Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? std::string("<none>") : files_[it->second]->path().filename().string();
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, _] : where_) out.push_back(name);
  return out;
}

}  // namespace bg

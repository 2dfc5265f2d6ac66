// make-random --poison-expert: overwrites one routed expert's down projection with NaN in a written checkpoint, so
// GPU and CPU runs can check that a numerical fault fails only the requests routed to that expert.
#include <fstream>
#include <regex>

#include "core/error.h"
#include "core/log.h"
#include "formats/safetensors.h"
#include "model/random_checkpoint.h"

namespace bg {
namespace {

// The NaN pattern of one element of `dtype`, little-endian; empty when the dtype cannot hold NaN (integer codes).
std::vector<uint8_t> nan_bytes(DType dtype, bool is_scale) {
  switch (dtype) {
    case DType::kF32: return {0x00, 0x00, 0xc0, 0x7f};
    case DType::kF16: return {0x00, 0x7e};
    case DType::kBF16: return {0xc0, 0x7f};
    case DType::kF8E4M3: return {0x7f};
    case DType::kF8E8M0: return {0xff};
    case DType::kU8: return is_scale ? std::vector<uint8_t>{0xff} : std::vector<uint8_t>{};  // E8M0 scale bytes
    default: return {};
  }
}

SafetensorsHeader read_header(std::fstream& f, const std::filesystem::path& path) {
  const uint64_t file_size = std::filesystem::file_size(path);
  std::vector<std::byte> head(8);
  f.read(reinterpret_cast<char*>(head.data()), 8);
  BG_CHECK(f.good(), "--poison-expert: cannot read {}", path.string());
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(std::to_integer<uint8_t>(head[i])) << (8 * i);
  BG_CHECK(len <= kMaxSafetensorsHeaderBytes && 8 + len <= file_size, "--poison-expert: bad header in {}",
           path.string());
  head.resize(8 + len);
  f.read(reinterpret_cast<char*>(head.data() + 8), static_cast<std::streamsize>(len));
  BG_CHECK(f.good(), "--poison-expert: cannot read the header of {}", path.string());
  return parse_safetensors_header(head, file_size, path.string());
}

// Fills one tensor with its NaN pattern; returns false when its dtype holds no NaN (MXFP4 codes: the scales carry it).
bool poison_tensor(const std::filesystem::path& path, const std::string& name) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  BG_CHECK(f.is_open(), "--poison-expert: cannot open {} for writing", path.string());
  const SafetensorsHeader h = read_header(f, path);
  for (const SafetensorsEntry& e : h.entries) {
    if (e.name != name) continue;
    const bool is_scale = name.find("scale") != std::string::npos;
    const std::vector<uint8_t> pattern = nan_bytes(e.dtype, is_scale);
    if (pattern.empty()) return false;
    std::vector<uint8_t> fill(e.nbytes);
    for (size_t i = 0; i < fill.size(); ++i) fill[i] = pattern[i % pattern.size()];
    f.seekp(static_cast<std::streamoff>(e.file_offset));
    f.write(reinterpret_cast<const char*>(fill.data()), static_cast<std::streamsize>(fill.size()));
    BG_CHECK(f.good(), "--poison-expert: writing '{}' into {} failed", name, path.string());
    return true;
  }
  fail("--poison-expert: '{}' is not in {}", name, path.string());
}

}  // namespace

void poison_random_expert(const std::filesystem::path& dir, const ExpertRef& target) {
  const std::filesystem::path index_path = dir / "model.safetensors.index.json";
  std::ifstream in(index_path);
  BG_CHECK(in.is_open(), "--poison-expert: no {}", index_path.string());
  const nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  BG_CHECK(!index.is_discarded() && index.contains("weight_map") && index["weight_map"].is_object(),
           "--poison-expert: {} has no weight_map", index_path.string());
  // The down projection of routed expert E in layer L: DeepSeek-V3 "layers.L.mlp.experts.E.down_proj.*", Kimi-K3
  // "layers.L.<moe>.experts.E.w2.*" (weights and their scales).
  const std::regex pattern(fmt::format(R"((^|\.)layers\.{}\..*\bexperts\.{}\.(down_proj|w2)\.)", target.layer,
                                       target.expert));
  int64_t n_found = 0, n_poisoned = 0;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    if (!std::regex_search(name, pattern) || !shard.is_string()) continue;
    ++n_found;
    if (poison_tensor(dir / shard.get<std::string>(), name)) ++n_poisoned;
  }
  BG_CHECK(n_found > 0, "--poison-expert {}:{}: the checkpoint has no routed expert {} in layer {} (a dense layer, or "
           "past the expert count)", target.layer, target.expert, target.expert, target.layer);
  BG_CHECK(n_poisoned > 0, "--poison-expert {}:{}: no tensor of that expert can hold NaN", target.layer,
           target.expert);
  log::warn("make-random: expert {} of layer {} poisoned (NaN in {} tensor(s) of its down projection)", target.expert,
            target.layer, n_poisoned);
}

}  // namespace bg

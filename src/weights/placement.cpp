// Placement: tensor name -> (group kind, layer, expert, order) from the architecture table's patterns.
#include "weights/placement.h"

#include <array>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "formats/json_fields.h"
#include "formats/kimi_k3_config.h"
#include "formats/model_config.h"
#include "model/deepseek_v3.h"
#include "model/kimi_k3.h"
#include "weights/checksum.h"

namespace bg::weights {
namespace {

// Reads a decimal number at text[pos...]; false when there is none or it is too long.
bool read_number(std::string_view text, size_t& pos, int64_t* out) {
  size_t start = pos;
  int64_t v = 0;
  while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9' && pos - start < 9) {
    v = v * 10 + (text[pos] - '0');
    ++pos;
  }
  if (pos == start) return false;
  *out = v;
  return true;
}

// The layer number after "layers." in a name outside the table, else -1.
int64_t layer_in_name(std::string_view name) {
  for (size_t at = name.find("layers."); at != std::string_view::npos; at = name.find("layers.", at + 1)) {
    if (at > 0 && name[at - 1] != '.') continue;
    size_t pos = at + 7;
    int64_t layer = -1;
    if (read_number(name, pos, &layer) && pos < name.size() && name[pos] == '.') return layer;
  }
  return -1;
}

}  // namespace

bool match_pattern(std::string_view pattern, std::string_view text, int64_t* layer, int64_t* expert) {
  *layer = -1;
  *expert = -1;
  size_t p = 0, t = 0;
  while (p < pattern.size()) {
    if (pattern.compare(p, 3, "{L}") == 0 || pattern.compare(p, 3, "{E}") == 0) {
      if (!read_number(text, t, pattern[p + 1] == 'L' ? layer : expert)) return false;
      p += 3;
      continue;
    }
    if (t >= text.size() || pattern[p] != text[t]) return false;
    ++p;
    ++t;
  }
  return t == text.size();
}

int linear_part(const std::string& name, std::string* prefix) {
  static const std::array<std::pair<std::string_view, int>, 6> kSuffixes = {{{".weight_scale_inv", 1},
                                                                            {".weight_packed", 0},
                                                                            {".weight_blocks", 0},
                                                                            {".weight_scales", 1},
                                                                            {".weight_scale", 1},
                                                                            {".weight", 0}}};
  for (const auto& [suffix, part] : kSuffixes) {
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      *prefix = name.substr(0, name.size() - suffix.size());
      return part;
    }
  }
  return -1;
}

uint64_t config_checksum(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  std::ifstream in(path, std::ios::binary);
  BG_CHECK(in.good(), "cannot read '{}'", path.string());
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return xxh64(std::as_bytes(std::span(text)));
}

ArchTable arch_table_for(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  const auto config = read_json_file(path);
  switch (detect_arch(config, path.string())) {
    case Arch::kDeepseekV3: return deepseek_v3_table(parse_deepseek_v3_config(config, path.string()));
    case Arch::kKimiK3: return kimi_k3_table(parse_kimi_k3_config(config, path.string()));
  }
  fail("{}: unknown architecture", path.string());
}

Placement Placement::for_model(const std::filesystem::path& dir) {
  Placement p;
  p.table_ = arch_table_for(dir);
  p.config_xxh64_ = config_checksum(dir);
  return p;
}

TensorPlacement Placement::classify(const std::string& name) const {
  std::string prefix;
  const int part = linear_part(name, &prefix);
  for (size_t i = 0; i < table_.specs.size(); ++i) {
    const TensorSpec& spec = table_.specs[i];
    const bool linear = spec.kind == TensorKind::kLinear;
    if (linear && part < 0) continue;
    int64_t layer = -1, expert = -1;
    if (!match_pattern(spec.pattern, linear ? std::string_view(prefix) : std::string_view(name), &layer, &expert)) {
      continue;
    }
    const bool layer_ok = spec.scope == Scope::kGlobal ||
                          (layer >= 0 && layer < table_.n_layers && (!spec.in_layer || spec.in_layer(layer)));
    const bool expert_ok = spec.scope != Scope::kExpert || (expert >= 0 && expert < table_.n_experts);
    if (!layer_ok || !expert_ok) continue;
    TensorPlacement tp;
    tp.kind = spec.scope == Scope::kExpert ? GroupKind::kExpert
              : spec.scope == Scope::kLayer ? GroupKind::kLayer
                                            : GroupKind::kGlobal;
    tp.layer = spec.scope == Scope::kGlobal ? -1 : layer;
    tp.expert = spec.scope == Scope::kExpert ? expert : -1;
    tp.order = static_cast<int32_t>(i) * 2 + std::max(part, 0);
    return tp;
  }
  TensorPlacement tp;
  tp.layer = layer_in_name(name);
  tp.kind = tp.layer >= 0 ? GroupKind::kLayer : GroupKind::kGlobal;
  tp.order = 1 << 20;
  return tp;
}

}  // namespace bg::weights

// Where each checkpoint tensor goes in the store layout, decided from the model's architecture table (config.json):
// a routed expert's linear parts -> that (layer, expert)'s block, in table order (gate, up, down; codes before
// scales); other tensors of a layer -> that layer's group; globals -> the global group. Names outside the table (MTP
// layers, vision tower) go by the "layers.<N>." in their name, else global.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "model/arch_table.h"
#include "weights/store_format.h"

namespace bg::weights {

struct TensorPlacement {
  GroupKind kind = GroupKind::kGlobal;
  int64_t layer = -1;
  int64_t expert = -1;
  int32_t order = 0;  // position inside the group (table order); names outside the table sort after, by name
};

class Placement {
 public:
  // Reads `dir`/config.json and builds the architecture's table. Throws bg::Error naming the file.
  static Placement for_model(const std::filesystem::path& dir);

  TensorPlacement classify(const std::string& name) const;
  const std::string& arch() const { return table_.arch; }
  uint64_t config_xxh64() const { return config_xxh64_; }
  const ArchTable& table() const { return table_; }
  // True when `name` is one part of a routed expert's linear weight (a Scope::kExpert linear of the table).
  bool is_expert_linear(const std::string& name) const { return classify(name).kind == GroupKind::kExpert; }

 private:
  ArchTable table_;
  uint64_t config_xxh64_ = 0;
};

// XXH64 of a model directory's config.json (the identity of the model a store holds).
uint64_t config_checksum(const std::filesystem::path& dir);

// The architecture table of the model in `dir` (config.json).
ArchTable arch_table_for(const std::filesystem::path& dir);

// Splits a linear tensor name into its prefix and part: ".weight"/".weight_packed"/".weight_blocks" -> 0 (codes),
// ".weight_scale_inv"/".weight_scale"/".weight_scales" -> 1 (scales); -1 when the name has none of these suffixes.
int linear_part(const std::string& name, std::string* prefix);

// Matches `text` against a table pattern with "{L}" / "{E}" placeholders (decimal numbers); fills layer / expert
// (-1 when the pattern has none). No allocation: used on every tensor name of a checkpoint.
bool match_pattern(std::string_view pattern, std::string_view text, int64_t* layer, int64_t* expert);

}  // namespace bg::weights

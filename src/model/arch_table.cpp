// Binding a checkpoint to an architecture table.
#include "model/arch_table.h"

#include <algorithm>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/log.h"

namespace bg {
namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size())) {
    s.replace(pos, from.size(), to);
  }
}

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string out;
  for (DType d : dtypes) out += (out.empty() ? "" : ", ") + std::string(dtype_name(d));
  return out;
}

}  // namespace

std::string expand_pattern(const std::string& pattern, int64_t layer, int64_t expert) {
  std::string s = pattern;
  replace_all(s, "{L}", std::to_string(layer));
  replace_all(s, "{E}", std::to_string(expert));
  return s;
}

uint64_t ModelWeights::key(int id, int64_t layer, int64_t expert) {
  return (static_cast<uint64_t>(id) << 48) | (static_cast<uint64_t>(layer + 1) << 24) |
         static_cast<uint64_t>(expert + 1);
}

ModelWeights::KeyParts ModelWeights::split_key(uint64_t key) {
  return {static_cast<int>(key >> 48), key_layer(key), key_expert(key)};
}

ModelWeights ModelWeights::bind(std::shared_ptr<const WeightSource> source, const ArchTable& table,
                                const BindOptions& options) {
  ModelWeights w;
  w.source_ = std::move(source);
  const WeightSource& c = *w.source_;
  std::set<std::string> consumed;
  // Position of each routed-expert linear among them (0 gate, 1 up, 2 down), -1 for the other specs.
  std::vector<int> expert_role(table.specs.size(), -1);
  int n_roles = 0;
  for (size_t i = 0; i < table.specs.size(); ++i) {
    if (table.specs[i].kind == TensorKind::kLinear && table.specs[i].scope == Scope::kExpert) {
      expert_role[i] = n_roles++;
    }
  }
  auto bind_one = [&](const TensorSpec& spec, int64_t layer, int64_t expert) {
    std::string name = expand_pattern(spec.pattern, layer, expert);
    if (spec.kind == TensorKind::kLinear) {
      Shape shape = spec.shape(layer);
      const int role = expert_role[static_cast<size_t>(&spec - table.specs.data())];
      std::optional<WeightSource::W4a16Block> blk;
      if (options.defer_w4a16_experts && role >= 0 && n_roles == 3) blk = c.w4a16_expert(layer, expert);
      bool packed = c.contains(name + ".weight_packed");
      if (blk) {
        const int64_t n_out = shape.at(0), n_in = shape.at(1);
        BG_CHECK(role < 2 ? (n_out == blk->inter && n_in == blk->hidden) : (n_out == blk->hidden && n_in == blk->inter),
                 "'{}' in {}: [{}, {}] but its W4A16 block holds hidden {} inter {}", name, c.describe(), n_out, n_in,
                 blk->hidden, blk->inter);
        QuantWeight q;
        q.format = WeightFormat::kMxfp4;
        q.n_out = n_out;
        q.n_in = n_in;
        q.name = name;
        q.data = {DType::kU8, {n_out, n_in / 2}, nullptr, static_cast<size_t>(n_out * n_in / 2),
                  name + (packed ? ".weight_packed" : ".weight_blocks")};
        q.scale = {DType::kU8, {n_out, n_in / kMxfp4GroupSize}, nullptr,
                   static_cast<size_t>(n_out * n_in / kMxfp4GroupSize),
                   name + (packed ? ".weight_scale" : ".weight_scales")};
        q.w4a16 = {blk->bytes, blk->hidden, blk->inter, blk->version, &c};
        for (auto& n : linear_tensor_names(name, q.format, packed)) consumed.insert(n);
        const uint64_t k = key(spec.id, layer, expert);
        if (w.linears_.emplace(k, std::move(q)).second) w.linear_order_.push_back(k);
        return;
      }
      QuantWeight q = load_linear(c, name, shape.at(0), shape.at(1));
      for (auto& n : linear_tensor_names(name, q.format, packed)) consumed.insert(n);
      const uint64_t k = key(spec.id, layer, expert);
      if (w.linears_.emplace(k, std::move(q)).second) w.linear_order_.push_back(k);
      return;
    }
    TensorView t = c.get(name);
    BG_CHECK(std::find(spec.dtypes.begin(), spec.dtypes.end(), t.dtype) != spec.dtypes.end(),
             "tensor '{}' in {}: dtype {} but {} expects one of {}", name, c.file_of(name), dtype_name(t.dtype),
             table.arch, dtype_list(spec.dtypes));
    if (spec.shape) {
      Shape want = spec.shape(layer);
      BG_CHECK(t.shape == want, "tensor '{}' in {}: shape {} but {} needs {}", name, c.file_of(name),
               shape_str(t.shape), table.arch, shape_str(want));
    }
    consumed.insert(name);
    w.tensors_[key(spec.id, layer, expert)] = t;
  };
  for (const auto& spec : table.specs) {
    if (spec.scope == Scope::kGlobal) {
      bind_one(spec, -1, -1);
      continue;
    }
    for (int64_t l = 0; l < table.n_layers; ++l) {
      if (spec.in_layer && !spec.in_layer(l)) continue;
      if (spec.scope == Scope::kLayer) {
        bind_one(spec, l, -1);
      } else {
        for (int64_t e = 0; e < table.n_experts; ++e) bind_one(spec, l, e);
      }
    }
  }
  int64_t n_skipped = 0;
  for (const auto& name : c.names()) {
    if (consumed.count(name)) continue;
    if (table.skip && table.skip(name)) {
      ++n_skipped;
      continue;
    }
    fail("tensor '{}' in {} is not part of the {} architecture ({})", name, c.file_of(name), table.arch,
         c.describe());
  }
  if (n_skipped > 0) log::info("{}: skipped {} tensors this engine does not use (MTP / vision)", table.arch, n_skipped);
  return w;
}

const QuantWeight& ModelWeights::linear(int id, int64_t layer, int64_t expert) const {
  auto it = linears_.find(key(id, layer, expert));
  BG_CHECK(it != linears_.end(), "internal: linear weight {} (layer {}, expert {}) was not bound", id, layer, expert);
  return it->second;
}

const QuantWeight& ModelWeights::linear_by_key(uint64_t key) const {
  auto it = linears_.find(key);
  BG_CHECK(it != linears_.end(), "internal: no linear weight with key {:#x}", key);
  return it->second;
}

const TensorView& ModelWeights::tensor(int id, int64_t layer) const {
  auto it = tensors_.find(key(id, layer, -1));
  BG_CHECK(it != tensors_.end(), "internal: tensor {} (layer {}) was not bound", id, layer);
  return it->second;
}

bool ModelWeights::has(int id, int64_t layer, int64_t expert) const {
  uint64_t k = key(id, layer, expert);
  return linears_.count(k) != 0 || tensors_.count(k) != 0;
}

}  // namespace bg

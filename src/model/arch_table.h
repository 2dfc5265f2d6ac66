// Architecture as data: every tensor of an architecture (name pattern, kind, scope, dtypes, shape formula). Binding a
// checkpoint to a table checks every tensor (missing, extra, mis-shaped, wrongly typed -> an error naming tensor and
// file) and gives the forward code weights by enum, never by string.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "formats/quant.h"

namespace bg {

class Checkpoint;

enum class TensorKind : uint8_t {
  kLinear,  // a [out, in] matrix in any stored linear format (dense, FP8 block, MXFP4); pattern has no ".weight"
  kTensor,  // any other tensor, read as stored (norms, biases, embeddings, conv weights)
};

enum class Scope : uint8_t { kGlobal, kLayer, kExpert };

struct TensorSpec {
  int id = 0;           // the architecture's enum value
  std::string pattern;  // "{L}" = layer index, "{E}" = expert index
  TensorKind kind = TensorKind::kTensor;
  Scope scope = Scope::kGlobal;
  std::vector<DType> dtypes;                    // kTensor: accepted dtypes
  std::function<bool(int64_t layer)> in_layer;  // kLayer/kExpert: which layers hold it (null: all)
  std::function<Shape(int64_t layer)> shape;    // kLinear: {out, in}
};

struct ArchTable {
  std::string arch;
  int64_t n_layers = 0;
  int64_t n_experts = 0;
  std::vector<TensorSpec> specs;
  // Checkpoint tensors this engine deliberately does not use (MTP layers, vision tower); each is logged, not an error.
  std::function<bool(const std::string& name)> skip;
};

// Expands `pattern` for a layer and expert.
std::string expand_pattern(const std::string& pattern, int64_t layer, int64_t expert);

// Weights bound to a table: the model's weight source. Views point into the checkpoint's mappings, which the
// ModelWeights keeps alive.
class ModelWeights {
 public:
  // Validates the whole checkpoint against the table; throws bg::Error naming the first bad tensor and its file.
  static ModelWeights bind(std::shared_ptr<const Checkpoint> ckpt, const ArchTable& table);

  const QuantWeight& linear(int id, int64_t layer = -1, int64_t expert = -1) const;
  const TensorView& tensor(int id, int64_t layer = -1) const;
  std::vector<float> tensor_f32(int id, int64_t layer = -1) const { return tensor(id, layer).to_f32(); }
  bool has(int id, int64_t layer = -1, int64_t expert = -1) const;
  const Checkpoint& checkpoint() const { return *ckpt_; }
  // Visits every bound linear weight with its key (see key()).
  void for_each_linear(const std::function<void(uint64_t key, const QuantWeight& w)>& fn) const {
    for (const auto& [k, w] : linears_) fn(k, w);
  }
  static uint64_t key(int id, int64_t layer, int64_t expert);
  struct KeyParts {
    int id = 0;
    int64_t layer = -1, expert = -1;
  };
  static KeyParts split_key(uint64_t key);

 private:
  std::shared_ptr<const Checkpoint> ckpt_;
  std::unordered_map<uint64_t, QuantWeight> linears_;
  std::unordered_map<uint64_t, TensorView> tensors_;
};

}  // namespace bg

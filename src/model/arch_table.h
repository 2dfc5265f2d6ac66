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
#include "formats/weight_source.h"

namespace bg {

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

struct BindOptions {
  // Routed experts the source holds as W4A16 blocks (a weight store with --expert-layout w4a16) are bound deferred:
  // QuantWeight::w4a16 set, no checkpoint bytes (so nothing is unpacked at load). For a CUDA engine, which copies the
  // blocks as they are; whatever needs the checkpoint bytes calls QuantWeight::resolved(). The expert specs of the
  // table are gate, up, down in table order (the store packs them in that order).
  bool defer_w4a16_experts = false;
};

// Weights bound to a table. Views point into the weight source's memory (checkpoint mappings or weight-store
// segments), which the ModelWeights keeps alive.
class ModelWeights {
 public:
  // Validates the whole source against the table; throws bg::Error naming the first bad tensor and its file.
  static ModelWeights bind(std::shared_ptr<const WeightSource> source, const ArchTable& table,
                           const BindOptions& options = {});

  const QuantWeight& linear(int id, int64_t layer = -1, int64_t expert = -1) const;
  const QuantWeight& linear_by_key(uint64_t key) const;
  const TensorView& tensor(int id, int64_t layer = -1) const;
  std::vector<float> tensor_f32(int id, int64_t layer = -1) const { return tensor(id, layer).to_f32(); }
  bool has(int id, int64_t layer = -1, int64_t expert = -1) const;
  const WeightSource& source() const { return *source_; }
  // Visits every bound linear weight with its key (see key()), in table order: spec by spec, then layer, then expert
  // (the order the weight store lays tensors out in, so uploads can copy contiguous runs).
  void for_each_linear(const std::function<void(uint64_t key, const QuantWeight& w)>& fn) const {
    for (uint64_t k : linear_order_) fn(k, linears_.at(k));
  }
  static uint64_t key(int id, int64_t layer, int64_t expert);
  struct KeyParts {
    int id = 0;
    int64_t layer = -1, expert = -1;
  };
  static KeyParts split_key(uint64_t key);
  // The (layer, expert) of a key (-1 where it has none).
  static int64_t key_layer(uint64_t key) { return static_cast<int64_t>((key >> 24) & 0xffffff) - 1; }
  static int64_t key_expert(uint64_t key) { return static_cast<int64_t>(key & 0xffffff) - 1; }

 private:
  std::shared_ptr<const WeightSource> source_;
  std::vector<uint64_t> linear_order_;
  std::unordered_map<uint64_t, QuantWeight> linears_;
  std::unordered_map<uint64_t, TensorView> tensors_;
};

}  // namespace bg

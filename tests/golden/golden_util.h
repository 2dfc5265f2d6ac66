// Helpers for the golden tests: reading shared/golden cases and comparing logit rows.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "model/model.h"

namespace bg::testing {

// The golden cases: $BG_GOLDEN_DIR when set (e.g. on the GPU machine), else the path configured at build time.
inline std::filesystem::path golden_dir() {
  const char* env = std::getenv("BG_GOLDEN_DIR");
  return std::filesystem::path(env != nullptr && env[0] != '\0' ? env : BG_GOLDEN_DIR);
}

struct GoldenPrompt {
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;  // prompt + greedy continuation
  std::vector<float> logits;    // [tokens.size(), vocab]
  std::vector<float> margin;    // [tokens.size()]
};

class GoldenCase {
 public:
  explicit GoldenCase(const std::filesystem::path& case_dir)
      : dir_(case_dir), file_(SafetensorsFile::open(case_dir / "golden.safetensors")) {}

  std::filesystem::path model_dir() const { return dir_ / "model"; }
  int64_t n_prompts() const {
    int64_t n = 0;
    while (file_->contains("prompt." + std::to_string(n))) ++n;
    return n;
  }
  GoldenPrompt prompt(int64_t i) const {
    GoldenPrompt g;
    std::string s = std::to_string(i);
    for (int64_t v : file_->view("prompt." + s).to_i64()) g.prompt.push_back(static_cast<int32_t>(v));
    for (int64_t v : file_->view("tokens." + s).to_i64()) g.tokens.push_back(static_cast<int32_t>(v));
    g.logits = file_->view("logits." + s).to_f32();
    g.margin = file_->view("margin." + s).to_f32();
    return g;
  }
  bool has(const std::string& name) const { return file_->contains(name); }
  TensorView view(const std::string& name) const { return file_->view(name); }

 private:
  std::filesystem::path dir_;
  std::unique_ptr<SafetensorsFile> file_;
};

// max |a - b| / max |ref| over one row.
inline double row_rel_error(const float* got, const float* ref, int64_t n) {
  double max_diff = 0.0, max_ref = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got[i]) - ref[i]));
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}

inline int32_t argmax_row(const float* row, int64_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// Max relative logit error per row that a bf16 engine is held to on the golden models under the reference's routing
// (the GPU golden test, the layer diffs and the bf16 emulation; docs/GPU.md says where the numbers come from).
inline double bf16_logit_bound(const std::string& arch) { return arch == "kimi_k3" ? 0.5 : 3e-2; }

// One model's expert choices in call order (Model::set_route_hook), recorded to force another model onto them.
struct RoutingTape {
  struct Record {
    int64_t layer = 0;
    std::vector<int32_t> ids;
    std::vector<float> weights;
  };
  std::vector<Record> records;
  size_t next = 0;  // replay position

  // Appends every MoE layer's routing, changing nothing.
  RouteHook recorder() {
    return [this](int64_t layer, int64_t, int64_t, std::vector<int32_t>& ids, std::vector<float>& w) {
      records.push_back({layer, ids, w});
      return false;
    };
  }
  // Replaces each MoE layer's routing by the next record (expected to be of the same layer and size).
  RouteHook replayer() {
    next = 0;
    return [this](int64_t layer, int64_t, int64_t, std::vector<int32_t>& ids, std::vector<float>& w) {
      EXPECT_LT(next, records.size()) << "more routing calls than recorded";
      if (next >= records.size()) return false;
      const Record& r = records[next++];
      EXPECT_EQ(r.layer, layer);
      EXPECT_EQ(r.ids.size(), ids.size());
      ids = r.ids;
      w = r.weights;
      return true;
    };
  }
  void clear() {
    records.clear();
    next = 0;
  }
};

}  // namespace bg::testing

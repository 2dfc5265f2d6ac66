// CUDA linear preparation (cuda_linears.h).
#include "backend/cuda/cuda_linears.h"

#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_moe.h"
#include "core/env.h"
#include "core/error.h"

namespace bg::cuda {

bool switch_from_env(const char* name) { return env_switch(name, true); }

bool linear_groups_from_env() { return switch_from_env("BG_LINEAR_GROUPS"); }

bool fusable_linears(std::span<const QuantWeight* const> parts) {
  if (parts.size() < 2) return false;
  for (const QuantWeight* w : parts) {
    if (w->format != WeightFormat::kDense || w->n_in != parts.front()->n_in || w->n_in % 8 != 0) return false;
  }
  return true;
}

PreparedLinears prepare_linears(WeightUploader& uploader, const LinearBatch& batch) {
  if (batch.n_experts > 0 && moe_w4a16_wanted() && w4a16_packable(batch.weights)) {
    // One layer's MXFP4 experts: nothing goes up now. prepare_experts packs them into the W4A16 layout, their only
    // device copy, or uploads them as they are where the layer cannot use it (streamed slots).
    PreparedLinears out;
    for (const QuantWeight* w : batch.weights) {
      ops::DeviceWeightStorage s;
      s.desc = {w->format, w->n_out, w->n_in, nullptr, nullptr};
      out.weights.push_back(std::make_unique<CudaLinear>(std::move(s), *w));
    }
    out.runs.resize(batch.runs.size());
    return out;
  }
  // Experts bound deferred (a weight store's W4A16 blocks) that go up in the checkpoint's format: their bytes first.
  std::deque<QuantWeight> resolved;
  std::vector<const QuantWeight*> weights(batch.weights.begin(), batch.weights.end());
  for (const QuantWeight*& w : weights) {
    if (!w->deferred()) continue;
    resolved.push_back(w->resolved());
    w = &resolved.back();
  }
  std::vector<LinearRun> glued;
  std::vector<bool> fuse(batch.runs.size());
  for (size_t i = 0; i < batch.runs.size(); ++i) {
    const LinearRun& r = batch.runs[i];
    BG_CHECK(r.first + r.count <= batch.weights.size(), "prepare_linears: run [{}, {}) past {} weights", r.first,
             r.first + r.count, batch.weights.size());
    fuse[i] = fusable_linears(std::span(weights).subspan(r.first, r.count));
    if (fuse[i]) glued.push_back(r);
  }
  std::vector<ops::DeviceWeightStorage> up = uploader.upload(weights, batch.n_experts, glued);
  PreparedLinears out;
  for (size_t ri = 0; ri < batch.runs.size(); ++ri) {
    const LinearRun& r = batch.runs[ri];
    if (!fuse[ri]) {
      out.runs.push_back(nullptr);
      continue;
    }
    // The run's rows, back to back from its first weight's: one [sum of n_out, n_in] dense weight in the same arena.
    ops::DeviceWeightStorage fused;
    fused.desc = up[r.first].desc;
    fused.desc.n_out = 0;
    fused.arena = up[r.first].arena;
    std::string name;
    for (size_t i = r.first; i < r.first + r.count; ++i) {
      fused.desc.n_out += weights[i]->n_out;
      name += (name.empty() ? "" : "|") + weights[i]->name;
    }
    QuantWeight like;
    like.format = WeightFormat::kDense;
    like.n_out = fused.desc.n_out;
    like.n_in = fused.desc.n_in;
    like.name = std::move(name);
    out.runs.push_back(std::make_unique<CudaLinear>(std::move(fused), like));
  }
  for (size_t i = 0; i < up.size(); ++i) {
    out.weights.push_back(std::make_unique<CudaLinear>(std::move(up[i]), *weights[i]));
  }
  return out;
}

}  // namespace bg::cuda

// load_model: architecture dispatch on config.json.
#include "model/model.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "formats/json_fields.h"
#include "formats/model_config.h"
#include "formats/kimi_k3_config.h"
#include "model/deepseek_v3.h"
#include "model/kimi_k3.h"

namespace bg {

void Model::forward_batch(std::span<const BatchEntry> batch, float* last_logits) {
  const auto vocab = static_cast<size_t>(info().vocab_size);
  std::vector<float> rows;
  for (size_t i = 0; i < batch.size(); ++i) {
    const BatchEntry& e = batch[i];
    BG_CHECK(e.seq != nullptr && !e.tokens.empty(), "forward_batch: entry {} has no sequence or no tokens", i);
    rows.resize(e.tokens.size() * vocab);
    forward(*e.seq, e.tokens, rows.data());
    std::copy(rows.end() - static_cast<std::ptrdiff_t>(vocab), rows.end(), last_logits + i * vocab);
  }
}

void Model::forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                                 std::span<ops::RowSample> out) {
  const int64_t vocab = info().vocab_size;
  std::vector<float> logits(batch.size() * static_cast<size_t>(vocab));
  forward_batch(batch, logits.data());
  ops::sample_rows_cpu(rows, logits.data(), static_cast<int64_t>(batch.size()), vocab, out);
}

std::unique_ptr<Model> load_model(const std::filesystem::path& dir, const LoadOptions& options) {
  BG_CHECK(std::filesystem::is_directory(dir), "model directory '{}' does not exist", dir.string());
  auto config_path = dir / "config.json";
  auto config = read_json_file(config_path);
  switch (detect_arch(config, config_path.string())) {
    case Arch::kDeepseekV3:
      return load_deepseek_v3(dir, parse_deepseek_v3_config(config, config_path.string()), options);
    case Arch::kKimiK3:
      return load_kimi_k3(dir, parse_kimi_k3_config(config, config_path.string()), options);
  }
  fail("{}: unknown architecture", config_path.string());
}

BindOptions bind_options(const LoadOptions& options) {
  (void)options;  // every backend takes deferred experts (BackendLinears resolves them for those that need bytes)
  BindOptions o;
  o.defer_w4a16_experts = true;
  return o;
}

std::unique_ptr<kv::StateManager> make_state(Model& model, int64_t max_sequences, int64_t max_tokens) {
  return std::make_unique<kv::StateManager>(model.backend(), model.state_geometry(),
                                            kv::StatePlan::simple(max_sequences, max_tokens));
}

}  // namespace bg

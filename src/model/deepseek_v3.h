// DeepSeek-V3 / Kimi-K2 architecture: tensor table and model loader.
#pragma once

#include <memory>

#include "formats/model_config.h"
#include "model/arch_table.h"
#include "model/model.h"

namespace bg {

enum class DsTensor : int {
  kEmbed,
  kLmHead,
  kFinalNorm,
  kInputNorm,
  kPostAttnNorm,
  kQProj,  // only without q-LoRA
  kQAProj,
  kQANorm,
  kQBProj,
  kKvAProj,
  kKvANorm,
  kKvBProj,
  kOProj,
  kMlpGate,
  kMlpUp,
  kMlpDown,
  kRouterGate,
  kRouterBias,
  kExpertGate,
  kExpertUp,
  kExpertDown,
  kSharedGate,
  kSharedUp,
  kSharedDown,
};

ArchTable deepseek_v3_table(const DeepseekV3Config& c);

std::unique_ptr<Model> load_deepseek_v3(const std::filesystem::path& dir, const DeepseekV3Config& config,
                                        const LoadOptions& options);

}  // namespace bg

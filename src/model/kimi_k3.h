// Kimi-K3 architecture: tensor table and model loader.
#pragma once

#include <memory>

#include "formats/kimi_k3_config.h"
#include "model/arch_table.h"
#include "model/model.h"

namespace bg {

enum class K3Tensor : int {
  kEmbed,
  kLmHead,
  kFinalNorm,
  kOutResNorm,
  kOutResProj,
  // every layer
  kInputNorm,
  kPostAttnNorm,
  kAttnResNorm,
  kAttnResProj,
  kMlpResNorm,
  kMlpResProj,
  // KDA layers
  kKdaQ,
  kKdaK,
  kKdaV,
  kKdaG,
  kKdaO,
  kKdaFA,
  kKdaFB,
  kKdaB,
  kKdaQConv,
  kKdaKConv,
  kKdaVConv,
  kKdaALog,
  kKdaDtBias,
  kKdaONorm,
  // MLA layers
  kMlaQA,
  kMlaQANorm,
  kMlaQB,
  kMlaQ,  // without q-LoRA
  kMlaKvA,
  kMlaKvANorm,
  kMlaKvB,
  kMlaG,
  kMlaO,
  // dense MLP
  kMlpGate,
  kMlpUp,
  kMlpDown,
  // latent MoE
  kRouterGate,
  kRouterBias,
  kLatentDown,
  kLatentNorm,
  kLatentUp,
  kSharedGate,
  kSharedUp,
  kSharedDown,
  kExpertW1,  // gate
  kExpertW2,  // down
  kExpertW3,  // up
};

ArchTable kimi_k3_table(const KimiK3Config& c);

std::unique_ptr<Model> load_kimi_k3(const std::filesystem::path& dir, const KimiK3Config& config,
                                    const LoadOptions& options);

}  // namespace bg

// Share rules of both architectures and the per-rank weight bytes of a checkpoint.
#include "model/rank_share.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "core/error.h"
#include "formats/checkpoint.h"
#include "formats/json_fields.h"
#include "formats/kimi_k3_config.h"
#include "formats/model_config.h"
#include "model/deepseek_v3.h"
#include "model/kimi_k3.h"
#include "moe/expert_stream.h"

namespace bg {

// Tensor parallelism splits heads (q, o), the dense / shared-expert intermediate and the vocabulary; routed experts
// live on one rank each; kv_b_proj is split per head on the host (set_kv_b) and never used as a linear.
LinearShare deepseek_v3_share(int id, int64_t expert, const ShareContext& c) {
  using T = DsTensor;
  switch (static_cast<T>(id)) {
    case T::kQProj:
    case T::kQBProj:
    case T::kMlpGate:
    case T::kMlpUp:
    case T::kSharedGate:
    case T::kSharedUp:
    case T::kLmHead:
      return c.split(ShareKind::kRows);
    case T::kOProj:
    case T::kMlpDown:
    case T::kSharedDown:
      return c.split(ShareKind::kCols);
    case T::kKvBProj:
      return {ShareKind::kSkip};
    case T::kExpertGate:
    case T::kExpertUp:
    case T::kExpertDown:
      return c.expert(expert);
    default:
      return {};
  }
}

// Tensor parallelism splits KDA and MLA heads (q/k/v/g/f_b/b, q_b, the MLA gate; o_proj by columns), the dense and
// shared-expert intermediate and the vocabulary; f_a, q_a, kv_a, the router and the latent projections stay whole;
// routed experts live on one rank each; kv_b_proj is split per head on the host (set_kv_b).
LinearShare kimi_k3_share(int id, int64_t expert, const ShareContext& c) {
  using T = K3Tensor;
  switch (static_cast<T>(id)) {
    case T::kKdaQ:
    case T::kKdaK:
    case T::kKdaV:
    case T::kKdaG:
    case T::kKdaFB:
    case T::kKdaB:
    case T::kMlaQB:
    case T::kMlaQ:
    case T::kMlaG:
    case T::kMlpGate:
    case T::kMlpUp:
    case T::kSharedGate:
    case T::kSharedUp:
    case T::kLmHead:
      return c.split(ShareKind::kRows);
    case T::kKdaO:
    case T::kMlaO:
    case T::kMlpDown:
    case T::kSharedDown:
      return c.split(ShareKind::kCols);
    case T::kMlaKvB:
      return {ShareKind::kSkip};
    case T::kExpertW1:
    case T::kExpertW2:
    case T::kExpertW3:
      return c.expert(expert);
    default:
      return {};
  }
}

RankWeightBytes rank_weight_bytes(const std::filesystem::path& dir, const dist::RankPlace& place) {
  const auto config_path = dir / "config.json";
  const auto config = read_json_file(config_path);
  std::shared_ptr<const Checkpoint> ckpt = Checkpoint::open(dir);
  ArchTable table;
  LinearShare (*rule)(int, int64_t, const ShareContext&) = nullptr;
  int64_t n_experts = 0;
  switch (detect_arch(config, config_path.string())) {
    case Arch::kDeepseekV3: {
      const DeepseekV3Config c = parse_deepseek_v3_config(config, config_path.string());
      table = deepseek_v3_table(c);
      rule = deepseek_v3_share;
      n_experts = c.n_routed_experts;
      break;
    }
    case Arch::kKimiK3: {
      const KimiK3Config c = parse_kimi_k3_config(config, config_path.string());
      table = kimi_k3_table(c);
      rule = kimi_k3_share;
      n_experts = c.n_experts;
      break;
    }
  }
  const ModelWeights w = ModelWeights::bind(ckpt, table);
  const moe::ExpertPlacement experts =
      moe::ExpertPlacement::contiguous(n_experts, place.layout.world(), place.rank);
  const ShareContext ctx{place.layout.tp(), place.tp_rank(), &experts};
  RankWeightBytes out;
  int64_t linear_total = 0;
  std::set<std::pair<int64_t, int64_t>> blocks;  // this rank's (layer, expert)
  bool all_mxfp4 = true;
  w.for_each_linear([&](uint64_t key, const QuantWeight& q) {
    const auto bytes = static_cast<int64_t>(q.data.nbytes + q.scale.nbytes);
    linear_total += bytes;
    const ModelWeights::KeyParts k = ModelWeights::split_key(key);
    const LinearShare s = rule(k.id, k.expert, ctx);
    if (k.expert >= 0) {
      out.experts += s.kind == ShareKind::kSkip ? 0 : bytes;
      if (s.kind != ShareKind::kSkip) {
        all_mxfp4 = all_mxfp4 && q.format == WeightFormat::kMxfp4;
        blocks.emplace(k.layer, k.expert);
      }
    } else if (s.kind == ShareKind::kRows || s.kind == ShareKind::kCols) {
      out.split += bytes / s.parts;
    } else if (s.kind == ShareKind::kAll) {
      out.whole += bytes;
    } else {
      out.split += bytes / ctx.tp;  // kv_b_proj: not a linear, but set_kv_b keeps this rank's heads of it
    }
  });
  int64_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.path().extension() == ".safetensors") {
      files += static_cast<int64_t>(entry.file_size());
    }
  }
  out.whole += std::max<int64_t>(0, files - linear_total);  // norms, embedding, biases, conv weights, headers
  out.n_expert_blocks = static_cast<int64_t>(blocks.size());
  out.n_local_experts = experts.n_local();
  out.experts_mxfp4 = all_mxfp4 && !blocks.empty();
  return out;
}

int64_t resident_expert_bytes(const RankWeightBytes& w, double fraction, int pool_copies) {
  const int64_t n_local = w.n_local_experts;
  if (fraction >= 1.0 || n_local <= 0 || w.n_expert_blocks == 0) return w.experts;
  const int64_t n_resident = std::clamp<int64_t>(std::llround(fraction * static_cast<double>(n_local)), 0, n_local);
  const int64_t per_expert = w.experts / w.n_expert_blocks;
  const int64_t n_layers = w.n_expert_blocks / n_local;
  // Resident experts, and the pool (moe::ExpertStream::pool_buffers: two layers' worth of streamed experts).
  const int64_t copies = w.experts_mxfp4 ? pool_copies : 1;  // the W4A16 block beside the copy target: MXFP4 only
  return per_expert * (n_layers * n_resident + copies * moe::ExpertStream::pool_buffers(n_local - n_resident));
}

}  // namespace bg

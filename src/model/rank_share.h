// Which part of a checkpoint one rank holds: its routed experts (ExpertPlacement), its tensor-parallel share of the
// split weights (each architecture's share rule), everything else whole. Used by the loaders (BackendLinears) and
// by the planner, which sizes each rank from its own share.
#pragma once

#include <cstdint>
#include <filesystem>

#include "dist/parallel_layout.h"
#include "model/tp_shard.h"
#include "moe/expert_table.h"

namespace bg {

struct ShareContext {
  int32_t tp = 1;
  int32_t tp_rank = 0;
  const moe::ExpertPlacement* experts = nullptr;  // null: every expert here
  LinearShare split(ShareKind kind) const { return {tp > 1 ? kind : ShareKind::kAll, tp, tp_rank}; }
  LinearShare expert(int64_t e) const {
    return {experts == nullptr || experts->owner(e) == experts->rank() ? ShareKind::kAll : ShareKind::kSkip};
  }
};

// The architectures' rules (tensor ids of DsTensor / K3Tensor).
LinearShare deepseek_v3_share(int id, int64_t expert, const ShareContext& c);
LinearShare kimi_k3_share(int id, int64_t expert, const ShareContext& c);

struct RankWeightBytes {
  int64_t experts = 0;  // this rank's routed experts
  int64_t n_expert_blocks = 0;  // its (layer, expert) pairs (experts / n_expert_blocks: one expert's bytes)
  int64_t n_local_experts = 0;  // its experts per MoE layer
  bool experts_mxfp4 = false;   // every one of its routed experts is MXFP4 (on CUDA: a W4A16 block per pool buffer)
  int64_t split = 0;    // its share of the tensor-parallel weights
  int64_t whole = 0;    // replicated on every rank (embedding, norms, router, latent projections, q_a / kv_a, ...)
  int64_t total() const { return experts + split + whole; }
};

// For the checkpoint in `dir` (headers only; nothing is read into memory). Throws bg::Error like load_model.
RankWeightBytes rank_weight_bytes(const std::filesystem::path& dir, const dist::RankPlace& place);

// What backend memory the experts take with --resident-experts `fraction`: the resident ones plus the streamed-expert
// pool (two layers' worth of streamed experts, moe/expert_stream.h), `pool_copies` times for MXFP4 experts (2 on CUDA:
// each buffer is the copy target and the expert's W4A16 block), once for any other format.
int64_t resident_expert_bytes(const RankWeightBytes& w, double fraction, int pool_copies = 1);

}  // namespace bg

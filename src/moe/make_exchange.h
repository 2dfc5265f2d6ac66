// The expert exchange of one rank of a set, by the rank context's choice: shm (CPU rank processes), nccl (all-to-all
// of bf16 rows, CUDA ranks on distinct GPUs) or ll (the low-latency fixed-slot exchange over CUDA IPC, CUDA ranks of
// one host, GPUs may be shared). One rank: the loopback.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "dist/rank_context.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe {

// Collective over ranks.world (every rank builds its exchange at the same point of loading). Throws bg::Error when
// the choice does not fit the backend (shm needs the CPU backend; nccl and ll need CUDA ranks).
std::unique_ptr<Exchange> make_rank_exchange(const dist::RankContext& ranks, Backend& backend,
                                             const ExpertPlacement& placement, int64_t top_k, int64_t hidden);

}  // namespace bg::moe

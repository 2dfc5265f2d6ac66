// The expert exchange of one rank of a set, by the rank context's choice: shm (CPU rank processes), nccl (all-to-all
// of bf16 rows, CUDA). ll (the low-latency fixed-slot exchange on CUDA) is not implemented yet: asking for it on CUDA
// ranks is an error, never a fallback. One rank: the loopback.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "dist/rank_context.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe {

// The error for --k3-moe-exchange ll on CUDA ranks (rank start and serve validation say the same).
inline constexpr const char* kLlNotAvailable =
    "--k3-moe-exchange ll is not available on CUDA ranks yet (the low-latency exchange has its wire layout and CPU "
    "reference in ops/moe_exchange, used by CPU rank sets, but no CUDA kernels); use --k3-moe-exchange nccl";

// Collective over ranks.world (every rank builds its exchange at the same point of loading). Throws bg::Error when
// the choice does not fit the backend (shm needs the CPU backend; nccl and ll need CUDA ranks).
std::unique_ptr<Exchange> make_rank_exchange(const dist::RankContext& ranks, Backend& backend,
                                             const ExpertPlacement& placement, int64_t top_k, int64_t hidden);

}  // namespace bg::moe

// The CPU expert exchange between rank processes on one host: the low-latency exchange's slot layout
// (ops/moe_exchange) in one POSIX shm segment that every rank maps, so the layout logic the CUDA `ll` exchange uses
// runs in CI. Waits go through the rank set (futex + peer liveness), so a dead rank fails the step instead of hanging.
#pragma once

#include <memory>

#include "dist/comm.h"
#include "dist/shm_set.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe {

struct ShmExchangeConfig {
  dist::Comm* world = nullptr;            // every rank (the segment's name is broadcast through it)
  const dist::ShmSet* set = nullptr;      // waits and failure handling
  ExpertPlacement placement;              // this rank's view (the same owners on every rank)
  int64_t top_k = 0;
  int64_t hidden = 0;                     // expert input/output width (Kimi-K3: the latent)
  int64_t max_tokens = 0;                 // tokens per rank per call; 0: chosen from the memory budget below
  int64_t region_budget_bytes = int64_t{64} << 20;  // per rank, when max_tokens is 0
};

// Collective: every rank of the world constructs it at the same point (rank 0 creates the segment).
std::unique_ptr<Exchange> make_shm_exchange(const ShmExchangeConfig& config);

}  // namespace bg::moe

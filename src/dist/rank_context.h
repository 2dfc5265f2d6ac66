// Everything a model needs to run as one rank of a set: where it sits (layout, rank), its communicators (the world
// and its DP group's TP ranks), which expert exchange to build, and the transport resources behind them. Built by
// dist/rank_setup.h after the rendezvous; shared by the model and the worker loop.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "dist/comm.h"
#include "dist/parallel_layout.h"

namespace bg::dist {

class ShmRankSet;

// The expert exchanges CUDA rank sets can ask for (--k3-moe-exchange): nccl, ll (bf16 rows) or ll-fp8 (the ll
// exchange with FP8 E4M3 dispatch rows). CPU rank sets always use the shared-memory one ("shm").
inline bool is_cuda_exchange(std::string_view e) { return e == "nccl" || e == "ll" || e == "ll-fp8"; }
inline bool is_ll_exchange(std::string_view e) { return e == "ll" || e == "ll-fp8"; }
inline constexpr const char* kCudaExchangeNames = "nccl, ll or ll-fp8";
// ll-fp8 quantizes the dispatched rows on the GPU. CPU rank sets use the exact shared-memory exchange, which has no FP8
// payload: asking for it there is an error, not a run that silently skips the rounding.
inline bool exchange_fits_device(std::string_view device, std::string_view exchange) {
  return device != "cpu" || exchange != "ll-fp8";
}
inline constexpr const char* kLlFp8NeedsCuda = "--k3-moe-exchange ll-fp8 quantizes the dispatched rows of CUDA ranks; "
                                               "CPU ranks use the exact shared-memory exchange: use --device cuda, or "
                                               "--k3-moe-exchange ll or nccl";

struct RankContext {
  RankPlace place;
  std::string exchange = "shm";           // the MoE exchange between ranks: shm (CPU), nccl, ll or ll-fp8 (CUDA)
  std::unique_ptr<Comm> world;             // every rank
  std::unique_ptr<Comm> tp;                // this DP group's TP ranks (size 1 without TP)
  std::shared_ptr<const ShmRankSet> shm;   // CPU rank sets: the shared segment (exchange waits use its rank set)
  std::shared_ptr<void> transport;         // CUDA: the NCCL communicators behind world/tp
  int64_t max_tokens_per_call = 0;         // exchange tokens per rank per call (0: the exchange's default)
  double timeout_s = 600.0;                // how long a rank waits for its peers before the set is failed

  int32_t rank() const { return place.rank; }
  int32_t world_size() const { return place.layout.world(); }
  int32_t tp_size() const { return place.layout.tp(); }
  int32_t tp_rank() const { return place.tp_rank(); }
};

}  // namespace bg::dist

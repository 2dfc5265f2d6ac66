// The expert exchanges between CUDA ranks (CUDA builds only):
// - nccl: an all-to-all of variable-size bf16 row batches (counts first, then grouped ncclSend/ncclRecv); host round
//   trips, not graph-capturable; ranks on distinct GPUs.
// - ll: the low-latency exchange (moe/cuda/ll_exchange.cu): fixed receive slots in each rank's device region, peers'
//   regions mapped through CUDA IPC, per-slot flags with system-scope release/acquire, no host synchronisation,
//   graph-capturable; ranks on the GPUs of one host, several ranks per GPU allowed.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "dist/rank_context.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::moe {

struct CudaExchangeConfig {
  const dist::RankContext* ranks = nullptr;  // the rank set (nccl: an NCCL rank set, dist/cuda/nccl_comm.h)
  ExpertPlacement placement;
  int64_t top_k = 0;
  int64_t hidden = 0;
  int64_t max_tokens = 0;  // 0: any number per call (nccl) / sized by the region budget (ll)
};

std::unique_ptr<Exchange> make_nccl_exchange(Backend& be, const CudaExchangeConfig& config);

// ---- ll --------------------------------------------------------------------------------------------------------
inline constexpr int kLlFlagBytes = 8;          // (epoch << 32) | (count + 1), one per (slot, source) and per source
inline constexpr int64_t kLlMaxTokens = 256;  // tokens per rank per call when sized by the budget

struct LlExchangeConfig {
  ExpertPlacement placement;
  int64_t top_k = 0;
  int64_t hidden = 0;                              // bf16 row width, a multiple of 8
  int64_t max_tokens = 0;                          // tokens per rank per call; 0: as many as region_budget_bytes holds
  int64_t region_budget_bytes = int64_t{2} << 30;  // both parities of one rank's region (capped at kLlMaxTokens)
  double timeout_s = 600.0;                        // a flag wait past this traps (the peer is taken for dead)
  bool capturable = true;                          // Exchange::capturable (tests may turn graphs off)
  // Dispatch rows as FP8 E4M3 with one fp32 scale per 128 values (hidden % 128 == 0): half the bytes, but the
  // experts then see quantized inputs (`--k3-moe-exchange ll-fp8`; ll_fp8_roundtrip_cpu is the exact rounding).
  bool fp8_dispatch = false;
  // Throws when a peer rank is gone or the set has failed (dist::ShmSet::check_peers). A watchdog thread calls it
  // every 50 ms; once it throws, every flag wait of this rank traps at once instead of waiting out timeout_s.
  std::function<void()> check_peers;
};

// Every rank's region (ll_exchange_region_bytes each, zeroed before the first call) as this process addresses it,
// in rank order; regions[rank] is this rank's own. `keep` owns the memory or the IPC mappings.
struct LlPeerRegions {
  std::vector<std::byte*> regions;
  std::shared_ptr<void> keep;
};

// The wire shape (ranks, slots per rank, tokens per call, top_k, hidden; bf16 rows) and one region's bytes.
ops::LlShape ll_exchange_shape(const LlExchangeConfig& config);
size_t ll_exchange_region_bytes(const LlExchangeConfig& config);

// An ll exchange over given regions (the tests map every rank of a set into one process this way). Kernels run on
// `be`'s stream; device errors go to its kernel error word.
std::unique_ptr<Exchange> make_ll_exchange(Backend& be, const LlExchangeConfig& config, LlPeerRegions peers);

// An ll exchange for one rank of a set: allocates and clears its region, hands its CUDA IPC handle to every rank over
// the world comm and opens theirs. Collective over the world.
std::unique_ptr<Exchange> make_ll_rank_exchange(Backend& be, const CudaExchangeConfig& config, double timeout_s);

}  // namespace bg::moe

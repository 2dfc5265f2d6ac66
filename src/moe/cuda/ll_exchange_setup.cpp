// The host side of the ll exchange's setup: its shape and region size from the placement and the budget, and, for a
// rank set, each rank's region allocated and mapped into every peer through CUDA IPC (handles over the world comm).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "dist/shm_comm.h"
#include "dist/shm_set.h"
#include "moe/cuda_exchange.h"
#include "ops/moe_exchange/moe_exchange.h"

namespace bg::moe {
namespace {

// Every rank's region mapped into this process through CUDA IPC (the handles travel over the world comm).
LlPeerRegions open_ipc_regions(dist::Comm& world, size_t bytes, const ops::LlShape& shape) {
  size_t free_bytes = 0, total_bytes = 0;
  BG_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  BG_CHECK(bytes < free_bytes, "ll exchange: rank {}'s region of {:.2f} GiB ({} tokens per call x {} ranks x {} slots) "
           "does not fit in the {:.2f} GiB free on its GPU; lower --moe-exchange-tokens", world.rank(),
           static_cast<double>(bytes) / (1 << 30), shape.max_tokens, shape.n_ranks, shape.n_local,
           static_cast<double>(free_bytes) / (1 << 30));
  void* mine = nullptr;
  BG_CUDA_CHECK(cudaMalloc(&mine, bytes));
  BG_CUDA_CHECK(cudaMemset(mine, 0, bytes));
  BG_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h{};
  BG_CUDA_CHECK(cudaIpcGetMemHandle(&h, mine));
  const auto* hb = reinterpret_cast<const std::byte*>(&h);
  // Every rank has cleared its region before any handle is handed out (the gather is a barrier).
  const std::vector<std::vector<std::byte>> all = world.all_gather_bytes({hb, sizeof(h)});
  const int me = world.rank();
  auto opened = std::make_shared<std::vector<void*>>();
  LlPeerRegions peers;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (r == me) {
      peers.regions.push_back(static_cast<std::byte*>(mine));
      continue;
    }
    BG_CHECK(all[static_cast<size_t>(r)].size() == sizeof(cudaIpcMemHandle_t), "ll exchange: rank {} sent an IPC "
             "handle of {} bytes", r, all[static_cast<size_t>(r)].size());
    cudaIpcMemHandle_t ph{};
    std::memcpy(&ph, all[static_cast<size_t>(r)].data(), sizeof(ph));
    void* p = nullptr;
    BG_CUDA_CHECK(cudaIpcOpenMemHandle(&p, ph, cudaIpcMemLazyEnablePeerAccess));  // a peer's region
    opened->push_back(p);
    peers.regions.push_back(static_cast<std::byte*>(p));
  }
  peers.keep = std::shared_ptr<void>(mine, [opened](void* q) {
    for (void* p : *opened) cudaIpcCloseMemHandle(p);
    cudaFree(q);
  });
  return peers;
}

}  // namespace

ops::LlShape ll_exchange_shape(const LlExchangeConfig& c) {
  const ExpertPlacement& p = c.placement;
  int64_t n_local = 1;
  for (int64_t r = 0; r < p.n_ranks(); ++r) n_local = std::max<int64_t>(n_local, p.experts_of(r).size());
  ops::LlShape s{p.n_ranks(), n_local, 1, c.top_k, c.hidden, c.fp8_dispatch, 2};
  if (c.max_tokens > 0) {
    s.max_tokens = c.max_tokens;
  } else {
    // Both parities of one token per rank: its dispatch messages to every (rank, slot) and its combine rows (the
    // layout's own row sizes, bf16 or FP8 payload).
    const ops::LlLayout one = ops::ll_layout(s, kLlFlagBytes);
    const auto per_token = static_cast<int64_t>(2 * (static_cast<size_t>(n_local * p.n_ranks()) * one.msg_bytes +
                                                     static_cast<size_t>(c.top_k) * one.combine_row_bytes));
    s.max_tokens = std::clamp<int64_t>(c.region_budget_bytes / std::max<int64_t>(per_token, 1), 1, kLlMaxTokens);
  }
  ops::ll_check_shape(s);
  return s;
}

size_t ll_exchange_region_bytes(const LlExchangeConfig& c) {
  return ops::ll_layout(ll_exchange_shape(c), kLlFlagBytes).region_bytes;
}

std::unique_ptr<Exchange> make_ll_rank_exchange(Backend& be, const CudaExchangeConfig& config, double timeout_s) {
  BG_CHECK(config.ranks != nullptr && config.ranks->world, "ll exchange: no rank context");
  LlExchangeConfig c;
  c.placement = config.placement;
  c.top_k = config.top_k;
  c.hidden = config.hidden;
  c.max_tokens = config.max_tokens;
  c.timeout_s = timeout_s;
  c.capturable = true;
  c.fp8_dispatch = config.ranks->exchange == "ll-fp8";
  if (config.ranks->shm) {
    std::shared_ptr<const dist::ShmRankSet> shm = config.ranks->shm;
    c.check_peers = [shm] { shm->set().check_peers(); };
  }
  LlPeerRegions peers = open_ipc_regions(*config.ranks->world, ll_exchange_region_bytes(c), ll_exchange_shape(c));
  return make_ll_exchange(be, c, std::move(peers));
}

}  // namespace bg::moe

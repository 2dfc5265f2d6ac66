// The expert exchanges between CUDA ranks (CUDA builds only): nccl, an all-to-all of variable-size bf16 row batches
// (counts first, then grouped ncclSend/ncclRecv). The low-latency `ll` exchange is not implemented on CUDA yet; asking
// for it is an error at rank start (dist/rank_setup.cpp), never a fallback.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "dist/rank_context.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg::moe {

struct CudaExchangeConfig {
  const dist::RankContext* ranks = nullptr;  // an NCCL rank set (dist/cuda/nccl_comm.h)
  ExpertPlacement placement;
  int64_t top_k = 0;
  int64_t hidden = 0;
  int64_t max_tokens = 0;  // 0: any number per call
};

std::unique_ptr<Exchange> make_nccl_exchange(Backend& be, const CudaExchangeConfig& config);

}  // namespace bg::moe

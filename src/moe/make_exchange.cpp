// Exchange selection for a rank of a set.
#include "moe/make_exchange.h"

#include "core/error.h"
#include "dist/rank_context.h"
#include "dist/shm_comm.h"
#include "moe/shm_exchange.h"

#ifdef BG_HAVE_CUDA
#include "moe/cuda_exchange.h"
#endif

namespace bg::moe {

std::unique_ptr<Exchange> make_rank_exchange(const dist::RankContext& ranks, Backend& backend,
                                             const ExpertPlacement& placement, int64_t top_k, int64_t hidden) {
  if (ranks.exchange == "shm") {
    BG_CHECK(backend.device() == DeviceKind::kCpu && backend.act_dtype() == DType::kF32 && ranks.shm,
             "the shm expert exchange needs CPU rank processes with the fp32 backend (got {})", backend.name());
    ShmExchangeConfig c;
    c.world = ranks.world.get();
    c.set = &ranks.shm->set();
    c.placement = placement;
    c.top_k = top_k;
    c.hidden = hidden;
    c.max_tokens = ranks.max_tokens_per_call;
    return make_shm_exchange(c);
  }
  BG_CHECK(dist::is_cuda_exchange(ranks.exchange), "unknown expert exchange '{}' (shm, {})", ranks.exchange,
           dist::kCudaExchangeNames);
  BG_CHECK(backend.device() == DeviceKind::kCuda, "the {} expert exchange needs CUDA ranks (got the {} backend)",
           ranks.exchange, backend.name());
#ifdef BG_HAVE_CUDA
  const CudaExchangeConfig c{&ranks, placement, top_k, hidden, ranks.max_tokens_per_call};
  if (dist::is_ll_exchange(ranks.exchange)) return make_ll_rank_exchange(backend, c, ranks.timeout_s);
  return make_nccl_exchange(backend, c);
#else
  fail("the {} expert exchange needs a batchgen built with CUDA", ranks.exchange);
#endif
}

}  // namespace bg::moe

// start_rank: transport id, rendezvous, communicators.
#include "dist/rank_setup.h"

#include <unistd.h>

#include <zmq.hpp>

#include "core/error.h"
#include "core/log.h"
#include "dist/rendezvous.h"
#include "dist/shm_comm.h"

#ifdef BG_HAVE_CUDA
#include "dist/cuda/nccl_comm.h"
#endif

namespace bg::dist {
namespace {

std::string host_name() {
  char buf[256] = {};
  gethostname(buf, sizeof(buf) - 1);
  return buf;
}

StartedRank start_cpu(const RankSetup& s, zmq::context_t& zctx, JoinInfo& me) {
  ShmCommOptions opt;
  opt.timeout_s = s.timeout_s;
  std::shared_ptr<ShmRankSet> shm;
  if (s.place.rank == 0) {
    shm = ShmRankSet::create(unique_shm_name("comm"), s.place, opt);
    me.transport_id = to_hex(shm->name().data(), shm->name().size());
  }
  const WorldInfo w = rendezvous_join(zctx, s.rendezvous, me, rank_timeout_s(s.timeout_s), s.abandon, s.link_key.get());
  if (s.place.rank != 0) {
    const std::vector<uint8_t> name = from_hex(w.transport_id);
    try {
      shm = ShmRankSet::open(std::string(name.begin(), name.end()), s.place, opt);
    } catch (const Error& e) {
      // Several --nnodes of CPU ranks work only where the "nodes" share one host's memory (ll is refused earlier).
      if (s.place.layout.nnodes() == 1) throw;
      fail("rank {}: {}; CPU ranks talk through shared memory and must all run on rank 0's host: across hosts use "
           "--device cuda with --k3-moe-exchange nccl", s.place.rank, e.what());
    }
  }
  shm->attach_and_wait();
  auto ctx = std::make_shared<RankContext>();
  ctx->place = s.place;
  ctx->exchange = "shm";
  ctx->world = shm->world_comm();
  ctx->tp = shm->tp_comm();
  ctx->shm = shm;
  ctx->max_tokens_per_call = s.max_tokens_per_call;
  ctx->timeout_s = rank_timeout_s(s.timeout_s);
  return {ctx, w.plan};
}

}  // namespace

StartedRank start_rank(const RankSetup& s) {
  BG_CHECK(s.device == "cpu" || s.device == "cuda", "rank setup: device '{}'", s.device);
  BG_CHECK(is_cuda_exchange(s.exchange), "--k3-moe-exchange {} must be {}", s.exchange, kCudaExchangeNames);
  BG_CHECK(exchange_fits_device(s.device, s.exchange), "{}", kLlFp8NeedsCuda);
  BG_CHECK(!s.rendezvous.empty(), "rank {}: no rendezvous endpoint", s.place.rank);
  zmq::context_t zctx(1);
  JoinInfo me;
  me.rank = s.place.rank;
  me.world = s.place.layout.world();
  me.layout = s.place.layout.describe();
  me.plan = s.plan;
  me.pid = getpid();
  me.host = host_name();
  log::info("rank {} of {} ({}): joining {}", s.place.rank, me.world, me.layout, s.rendezvous);
  if (s.device == "cpu") {
    if (s.place.rank == 0) {
      log::info("rank set on CPU: the expert exchange is the shared-memory one (--k3-moe-exchange {} applies to "
                "CUDA ranks)", s.exchange);
    }
    StartedRank r = start_cpu(s, zctx, me);
    log::info("rank {}: joined; shared-memory comms up", s.place.rank);
    return r;
  }
#ifdef BG_HAVE_CUDA
  // Before joining: a rank without its GPU (or a layout the exchange cannot run) fails now, not after the others wait.
  BG_CHECK(s.exchange == "nccl" || s.place.layout.nnodes() == 1, "rank {}: --k3-moe-exchange ll runs within one host "
           "(CUDA IPC); {} nodes need --k3-moe-exchange nccl", s.place.rank, s.place.layout.nnodes());
  const int device = select_rank_gpu(s.place, is_ll_exchange(s.exchange));
  if (is_ll_exchange(s.exchange)) {
    // The ll exchange maps its peers' device regions through CUDA IPC and needs no NCCL: the set's own collectives
    // (step agreement, TP sums) go through shared memory, so ranks of one host may share GPUs.
    StartedRank r = start_cpu(s, zctx, me);
    r.ranks->exchange = s.exchange;
    log::info("rank {}: joined on GPU {}; shared-memory comms up (ll exchange over CUDA IPC)", s.place.rank, device);
    return r;
  }
  NcclUniqueIdBytes id{};
  if (s.place.rank == 0) {
    id = nccl_unique_id();
    me.transport_id = to_hex(id.data(), id.size());
  }
  const WorldInfo w = rendezvous_join(zctx, s.rendezvous, me, rank_timeout_s(s.timeout_s), s.abandon, s.link_key.get());
  const std::vector<uint8_t> bytes = from_hex(w.transport_id);
  BG_CHECK(bytes.size() == id.size(), "rank {}: an NCCL unique id of {} bytes", s.place.rank, bytes.size());
  std::copy(bytes.begin(), bytes.end(), id.begin());
  auto ctx = make_nccl_rank_context(id, s.place, rank_timeout_s(s.timeout_s));
  ctx->exchange = s.exchange;
  ctx->max_tokens_per_call = s.max_tokens_per_call;
  ctx->timeout_s = rank_timeout_s(s.timeout_s);
  log::info("rank {}: joined; NCCL comms up ({} exchange)", s.place.rank, s.exchange);
  return {ctx, w.plan};
#else
  fail("rank {}: --device cuda needs a batchgen built with CUDA", s.place.rank);
#endif
}

}  // namespace bg::dist

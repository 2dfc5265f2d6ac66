// NCCL between CUDA ranks: the set's communicators (world and this DP group's TP ranks), the Comm collectives over
// them, and the bounded wait that turns a dead or hung peer into RankFailure instead of a hang. CUDA builds only.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "dist/rank_context.h"

namespace bg::dist {

using NcclUniqueIdBytes = std::array<uint8_t, NCCL_UNIQUE_ID_BYTES>;

// Rank 0 creates the set's id (handed to the others by the rendezvous).
NcclUniqueIdBytes nccl_unique_id();

// The communicators of one rank and the stream its collectives run on. The rank's GPU is its local rank (made current
// here, so the backend created later on this thread uses it); more ranks per host than GPUs is an error.
struct NcclTransport {
  ncclComm_t world = nullptr;
  ncclComm_t tp = nullptr;  // == world when the whole set is one TP group
  cudaStream_t stream = nullptr;
  int device = 0;
  double timeout_s = 600.0;
  bool aborted = false;
  ~NcclTransport();
  // Waits for the work queued on `stream` under `comm` for at most timeout_s; on an NCCL error or the timeout the
  // communicators are aborted and RankFailure names `what`.
  void wait(ncclComm_t comm, const char* what);
  void abort_all();
};

// Makes this rank's GPU current: its local rank, or (shared = true, the ll exchange's CUDA-IPC rank sets) its local
// rank modulo the visible GPUs, so several ranks may share one GPU. Returns the device ordinal.
int select_rank_gpu(const RankPlace& place, bool shared);

// Joins the set: world communicator from `id`, TP communicator split by DP group. Collective over the world.
std::shared_ptr<RankContext> make_nccl_rank_context(const NcclUniqueIdBytes& id, const RankPlace& place,
                                                    double timeout_s);

// The NCCL communicators behind a rank context (throws when it is not an NCCL rank set).
NcclTransport& nccl_transport(const RankContext& ranks);

}  // namespace bg::dist

// Collectives between CPU rank processes through one POSIX shm segment: a control block (shm_set.h), then one channel
// per group (the world, and each DP group's TP ranks). A channel gives every member a slot of two buffers used in
// turn: a collective round writes this member's part into buffer (round % 2), publishes the round number, waits for
// every member's, then reads theirs. A member can only be two rounds ahead of a reader after that reader posted the
// round in between, so the buffer it overwrites has been read. Large tensors go in chunks of the slot size.
#pragma once

#include <memory>
#include <string>

#include "dist/comm.h"
#include "dist/shm_set.h"

namespace bg::dist {

struct ShmCommOptions {
  size_t slot_bytes = size_t{256} << 10;  // per member and buffer; bigger collectives run in several rounds
  double timeout_s = 600.0;               // longest wait for a peer (BG_RANK_TIMEOUT_S overrides)
};

// The shared memory of a CPU rank set: created by rank 0 (before the rendezvous, so its name can be handed out),
// attached by the others. Comms made from it stay valid while it lives.
class ShmRankSet {
 public:
  static std::unique_ptr<ShmRankSet> create(const std::string& name, const RankPlace& place,
                                            const ShmCommOptions& options = {});
  static std::unique_ptr<ShmRankSet> open(const std::string& name, const RankPlace& place,
                                          const ShmCommOptions& options = {});
  // Waits until every rank attached, then (rank 0) removes the name.
  void attach_and_wait();

  const ShmSet& set() const { return *set_; }
  const RankPlace& place() const { return place_; }
  const std::string& name() const { return segment_.name(); }
  // The world (member = rank) and this rank's TP group (member = TP rank).
  std::unique_ptr<Comm> world_comm() const;
  std::unique_ptr<Comm> tp_comm() const;

 private:
  ShmRankSet(ShmSegment segment, const RankPlace& place, const ShmCommOptions& options);
  ShmSegment segment_;
  RankPlace place_;
  ShmCommOptions options_;
  std::unique_ptr<ShmSet> set_;
};

// Bytes of a rank set's comm segment.
size_t shm_comm_bytes(const ParallelLayout& layout, size_t slot_bytes);

// BG_RANK_TIMEOUT_S, else `fallback`.
double rank_timeout_s(double fallback);

}  // namespace bg::dist

// Bringing up one rank of a set: prepare the transport (rank 0: create the shm segment or the NCCL unique id), join
// the rendezvous, then build the communicators (collective) and the RankContext the model runs with.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/link_key.h"
#include "dist/rank_context.h"

namespace bg::dist {

struct RankSetup {
  RankPlace place;
  std::string device = "cpu";       // cpu: shared-memory comms and exchange; cuda: NCCL
  std::string exchange = "nccl";    // --k3-moe-exchange (cuda: nccl | ll; cpu: always shm)
  std::string rendezvous;           // the rendezvous endpoint
  std::vector<int64_t> plan;        // this rank's plan numbers (the set agrees on the minimum)
  double timeout_s = 600.0;         // joining and every later wait for a peer (BG_RANK_TIMEOUT_S overrides)
  int64_t max_tokens_per_call = 0;  // expert exchange tokens per rank per call (0: the exchange's default)
  std::function<bool()> abandon;    // polled while joining: true gives up (shutdown while loading)
  LinkKeyPtr link_key;              // --node-secret-file's key: the rendezvous is a CURVE server (null: none)
};

struct StartedRank {
  std::shared_ptr<RankContext> ranks;
  std::vector<int64_t> plan;  // the agreed plan
};

// Throws bg::Error (join rejected or timed out, transport failure).
StartedRank start_rank(const RankSetup& setup);

}  // namespace bg::dist

// Fetching what this node lacks from its peers: connect to the other nodes of the distributed config, pick for every
// missing tensor the first peer (config order) that serves it, and fetch it (checksum-verified) into a store's slots
// (weightd --fetch-missing) or into private memory laid out like a store (an engine).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "weights/dist_config.h"
#include "weights/peer_client.h"
#include "weights/placement.h"
#include "weights/store_layout.h"
#include "weights/store_source.h"

namespace bg::weights {

struct PeerSet {
  std::vector<std::unique_ptr<PeerClient>> clients;
  // Connects to the nodes that hold what is missing here: the shards (by the checkpoint index in `model_dir`) of
  // every tensor `have` lacks, each from the first node (config order, never `self_node`) that lists it. Throws
  // naming a shard no other node holds. Without an index: every other node that lists shards.
  static PeerSet connect(const DistConfig& config, const std::string& self_node,
                         const std::filesystem::path& model_dir, const std::function<bool(const std::string&)>& have,
                         const PeerClientOptions& o = {});
};

struct RemoteTensor {
  size_t client = 0;   // index into PeerSet::clients
  uint32_t index = 0;  // tensor index in that peer's manifest
};

// For every tensor some peer serves and `have` says is not local: where to fetch it from.
std::map<std::string, RemoteTensor> plan_fetch(const PeerSet& peers, const std::function<bool(const std::string&)>& have);

// The planned tensors as PlannedTensors (placement from the model's table; source index = first_source + client).
std::vector<PlannedTensor> remote_planned(const PeerSet& peers, const std::map<std::string, RemoteTensor>& plan,
                                          const Placement& placement, uint32_t first_source);

// Fetches every planned tensor into its place in `m` / `segments` (the tensors named in `plan`) and records its
// checksum in the manifest. Progress per peer.
void fetch_into(PeerSet& peers, const std::map<std::string, RemoteTensor>& plan, Manifest& m,
                const std::vector<MappedSegment>& segments, int progress_tty);

// An engine's view of the tensors it fetched: private memory in the store layout, as a StoreSource.
std::shared_ptr<StoreSource> fetch_to_private(PeerSet& peers, const std::map<std::string, RemoteTensor>& plan,
                                              const Placement& placement, int progress_tty);

}  // namespace bg::weights

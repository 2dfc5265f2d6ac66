// PeerSet, fetch planning, and fetching into store slots or private memory.
#include "weights/peer_fetch.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "formats/json_fields.h"
#include "weights/progress.h"
#include "weights/store_builder.h"

namespace bg::weights {

PeerSet PeerSet::connect(const DistConfig& config, const std::string& self_node, const std::filesystem::path& model_dir,
                         const std::function<bool(const std::string&)>& have, const PeerClientOptions& o) {
  std::set<std::string> missing;  // shard file names
  const auto index_path = model_dir / "model.safetensors.index.json";
  const bool indexed = std::filesystem::exists(index_path);
  if (indexed) {
    const auto index = read_json_file(index_path);
    BG_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
             "{}: missing object 'weight_map'", index_path.string());
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (shard.is_string() && !have(name)) missing.insert(shard.get<std::string>());
    }
  }
  std::set<std::string> chosen;
  for (const std::string& shard : missing) {
    const DistNode* holder = nullptr;
    for (const DistNode& n : config.nodes) {
      if (n.name != self_node && std::find(n.shards.begin(), n.shards.end(), shard) != n.shards.end()) {
        holder = &n;
        break;
      }
    }
    BG_CHECK(holder != nullptr, "{}: shard {} is needed here but no other node lists it", config.path.string(), shard);
    chosen.insert(holder->name);
  }
  PeerSet s;
  for (const DistNode& n : config.nodes) {
    const bool wanted = indexed ? chosen.count(n.name) != 0 : (n.name != self_node && !n.shards.empty());
    if (wanted) s.clients.push_back(std::make_unique<PeerClient>(n.name, n.host, n.port, config.secret, o));
  }
  return s;
}

std::map<std::string, RemoteTensor> plan_fetch(const PeerSet& peers,
                                               const std::function<bool(const std::string&)>& have) {
  std::map<std::string, RemoteTensor> plan;
  for (size_t c = 0; c < peers.clients.size(); ++c) {
    const Manifest& m = peers.clients[c]->manifest();
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const std::string& name = m.tensors[i].name;
      if (!have(name) && plan.count(name) == 0) plan[name] = {c, static_cast<uint32_t>(i)};
    }
  }
  return plan;
}

std::vector<PlannedTensor> remote_planned(const PeerSet& peers, const std::map<std::string, RemoteTensor>& plan,
                                          const Placement& placement, uint32_t first_source) {
  std::vector<PlannedTensor> out;
  for (const auto& [name, where] : plan) {
    const TensorInfo& t = peers.clients[where.client]->manifest().tensors[where.index];
    out.push_back({name, t.dtype, t.shape, t.bytes, first_source + static_cast<uint32_t>(where.client),
                   placement.classify(name)});
  }
  return out;
}

void fetch_into(PeerSet& peers, const std::map<std::string, RemoteTensor>& plan, Manifest& m,
                const std::vector<MappedSegment>& segments, int progress_tty) {
  std::vector<LoadProgress::File> files;
  for (const auto& c : peers.clients) files.push_back({"peer " + c->node(), 0});
  for (const auto& [name, where] : plan) {
    files[where.client].total_bytes += peers.clients[where.client]->manifest().tensors[where.index].bytes;
  }
  LoadProgress progress("fetching from peers", files, {.tty = progress_tty});
  progress.start();
  for (const auto& [name, where] : plan) {
    auto it = m.by_name.find(name);
    BG_CHECK(it != m.by_name.end(), "internal: fetched tensor '{}' has no place in the store", name);
    TensorInfo& t = m.tensors[it->second];
    PeerClient& client = *peers.clients[where.client];
    const TensorInfo& remote = client.manifest().tensors[where.index];
    // The place was planned from the peer's own dtype and shape; check again that the byte count matches it.
    BG_CHECK(remote.bytes == t.bytes, "{}: tensor '{}' of {} bytes does not fit its {} byte place", client.node(), name,
             remote.bytes, t.bytes);
    client.fetch(where.index, segments[t.segment].data() + t.offset);
    t.xxh64 = remote.xxh64;
    progress.add(where.client, t.bytes);
  }
  progress.finish();
}

std::shared_ptr<StoreSource> fetch_to_private(PeerSet& peers, const std::map<std::string, RemoteTensor>& plan,
                                              const Placement& placement, int progress_tty) {
  std::vector<std::string> sources;
  for (const auto& c : peers.clients) sources.push_back("peer:" + c->node());
  Manifest m = plan_layout(remote_planned(peers, plan, placement, 0), sources, {},
                           {placement.arch(), placement.config_xxh64(), new_generation()});
  std::vector<MappedSegment> segments;
  for (size_t i = 0; i < m.segments.size(); ++i) {
    segments.push_back(MappedSegment::anonymous(m.segments[i].bytes));
    const SegmentHeader h = make_segment_header(m, static_cast<uint32_t>(i));
    std::memcpy(segments.back().data(), &h, sizeof(h));
  }
  fetch_into(peers, plan, m, segments, progress_tty);
  std::string names;
  for (const auto& c : peers.clients) names += (names.empty() ? "" : ", ") + c->node();
  return std::make_shared<StoreSource>("tensors fetched from peers " + names, std::move(m), std::move(segments));
}

}  // namespace bg::weights

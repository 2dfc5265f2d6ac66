// --distributed-weight-config: which node's daemon holds which checkpoint shards, where its peer endpoint listens
// (UCX over RDMA where present, TCP otherwise) and the shared secret peers authenticate each other with.
//
//   {"version": 1, "secret_file": "weights.secret",
//    "nodes": [{"name": "n0", "host": "10.0.0.1", "port": 18515, "store": "k3", "shards": ["model-00001-of-00002..."]},
//              {"name": "n1", "host": "10.0.0.2", "port": 18515, "store": "k3", "shards": ["model-00002-of-00002..."]}]}
//
// "secret" (inline) or "secret_file" (relative to the config's directory): at least 32 bytes; a file that holds the
// secret must not be readable by group or others.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace bg::weights {

struct DistNode {
  std::string name;
  std::string host;   // numeric address or a host name
  uint16_t port = 0;
  std::string store;  // the weightd store name on that node
  std::vector<std::string> shards;
};

struct DistConfig {
  std::filesystem::path path;
  std::vector<DistNode> nodes;
  std::string secret;

  // Throws naming the config when there is no such node.
  const DistNode& node(const std::string& name) const;
  // The node whose daemon serves store `store` (the local node of an engine attached with --weight-store), or null.
  const DistNode* node_of_store(const std::string& store) const;
};

// Reads and validates (JSON types, unique names and endpoints, plain shard names, the secret's length and file mode).
// Throws bg::Error naming the file and field.
DistConfig load_dist_config(const std::filesystem::path& path);

}  // namespace bg::weights

// load_dist_config: every field type-checked; secrets never printed.
#include "weights/dist_config.h"

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/secret_file.h"
#include "weights/segment.h"

namespace bg::weights {
namespace {

using json = nlohmann::json;
std::string get_string(const json& j, const char* key, const std::string& where) {
  BG_CHECK(j.contains(key) && j[key].is_string() && !j[key].get_ref<const std::string&>().empty(),
           "{}: '{}' must be a non-empty string", where, key);
  return j[key].get<std::string>();
}

DistNode parse_node(const json& j, const std::string& where) {
  BG_CHECK(j.is_object(), "{}: must be an object", where);
  for (const auto& [key, _] : j.items()) {
    BG_CHECK(key == "name" || key == "host" || key == "port" || key == "store" || key == "shards",
             "{}: unknown field '{}' (name, host, port, store, shards)", where, key);
  }
  DistNode n;
  n.name = get_string(j, "name", where);
  n.host = get_string(j, "host", where);
  n.store = get_string(j, "store", where);
  check_store_name(n.store);
  BG_CHECK(j.contains("port") && j["port"].is_number_integer() && j["port"].get<int64_t>() >= 1 &&
               j["port"].get<int64_t>() <= 65535,
           "{}: 'port' must be an integer in [1, 65535]", where);
  n.port = static_cast<uint16_t>(j["port"].get<int64_t>());
  BG_CHECK(j.contains("shards") && j["shards"].is_array(), "{}: 'shards' must be an array of shard file names", where);
  for (const auto& s : j["shards"]) {
    BG_CHECK(s.is_string(), "{}: 'shards' must hold strings", where);
    const auto& name = s.get_ref<const std::string&>();
    BG_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != ".." &&
                 name.find('\0') == std::string::npos,
             "{}: shard '{}' is not a plain file name", where, name);
    n.shards.push_back(name);
  }
  return n;
}

}  // namespace

const DistNode& DistConfig::node(const std::string& name) const {
  for (const DistNode& n : nodes) {
    if (n.name == name) return n;
  }
  std::string known;
  for (const DistNode& n : nodes) known += (known.empty() ? "" : ", ") + n.name;
  fail("{}: no node named '{}' (nodes: {})", path.string(), name, known);
}

const DistNode* DistConfig::node_of_store(const std::string& store) const {
  for (const DistNode& n : nodes) {
    if (n.store == store) return &n;
  }
  return nullptr;
}

DistConfig load_dist_config(const std::filesystem::path& path) {
  const std::string what = "--distributed-weight-config " + path.string();
  std::ifstream in(path);
  BG_CHECK(in.good(), "{}: cannot read the file", what);
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  BG_CHECK(!j.is_discarded() && j.is_object(), "{}: not valid JSON, or not a JSON object", what);
  for (const auto& [key, _] : j.items()) {
    BG_CHECK(key == "version" || key == "secret" || key == "secret_file" || key == "nodes",
             "{}: unknown field '{}' (version, secret, secret_file, nodes)", what, key);
  }
  BG_CHECK(j.contains("version") && j["version"].is_number_integer() && j["version"].get<int64_t>() == 1,
           "{}: 'version' must be 1", what);
  DistConfig c;
  c.path = path;
  BG_CHECK(j.contains("secret") != j.contains("secret_file"), "{}: give exactly one of 'secret' and 'secret_file'",
           what);
  if (j.contains("secret")) {
    c.secret = get_string(j, "secret", what);
    // An inline secret is only as private as the config file.
    read_private_file(path, what);
    BG_CHECK(c.secret.size() >= kMinSecretBytes, "{}: the shared secret has {} bytes; at least {} are required", what,
             c.secret.size(), kMinSecretBytes);
  } else {
    std::filesystem::path sf = get_string(j, "secret_file", what);
    if (sf.is_relative()) sf = path.parent_path() / sf;
    c.secret = read_secret_file(sf, what);
  }
  BG_CHECK(j.contains("nodes") && j["nodes"].is_array() && !j["nodes"].empty(), "{}: 'nodes' must be a non-empty array",
           what);
  std::set<std::string> names, endpoints;
  for (size_t i = 0; i < j["nodes"].size(); ++i) {
    DistNode n = parse_node(j["nodes"][i], fmt::format("{}: nodes[{}]", what, i));
    BG_CHECK(names.insert(n.name).second, "{}: node name '{}' appears twice", what, n.name);
    BG_CHECK(endpoints.insert(fmt::format("{}:{}", n.host, n.port)).second, "{}: {}:{} is used by two nodes", what,
             n.host, n.port);
    c.nodes.push_back(std::move(n));
  }
  return c;
}

}  // namespace bg::weights

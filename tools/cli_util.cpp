// CLI parsing helpers.
#include "tools/cli_util.h"

#include <charconv>
#include <limits>

#include "core/error.h"

namespace bg::tools {

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    BG_CHECK(b != std::string::npos, "{}: empty element in '{}'", what, text);
    item = item.substr(b, e - b + 1);
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    BG_CHECK(ec == std::errc() && ptr == item.data() + item.size() && v >= 0 &&
                 v <= std::numeric_limits<int32_t>::max(),
             "{}: '{}' is not a token id", what, item);
    ids.push_back(static_cast<int32_t>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

void add_weight_source_options(CLI::App* cmd, std::string& weight_store, std::string& distributed_weight_config) {
  cmd->add_option("--weight-store", weight_store, "Attach to the weightd store NAME instead of reading the checkpoint "
                  "files (`batchgen weightd start --model DIR --name NAME`)");
  cmd->add_option("--distributed-weight-config", distributed_weight_config,
                  "Fetch the tensors this node lacks from the peer daemons this JSON names (docs/WEIGHTS.md)");
}

void add_expert_residency_options(CLI::App* cmd, double& resident_experts, std::string& expert_trace) {
  cmd->add_option("--resident-experts", resident_experts, "Fraction of each MoE layer's experts kept in backend "
                  "memory; the others are copied in from host memory when routed (same outputs; CPU and CUDA; "
                  "docs/WEIGHTS.md \"Streamed experts\"). Default 1")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--expert-trace", expert_trace, "Routing counts (JSON, docs/WEIGHTS.md) that choose the resident "
                  "experts: the most routed stay")
      ->check(CLI::ExistingFile);
}

}  // namespace bg::tools

// Parsing helpers shared by the subcommands.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace bg::tools {

// "5,17,3" -> {5, 17, 3}; spaces allowed; throws bg::Error naming the bad element.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what);

// --weight-store NAME and --distributed-weight-config PATH (docs/WEIGHTS.md), shared by the engine commands.
void add_weight_source_options(CLI::App* cmd, std::string& weight_store, std::string& distributed_weight_config);
// --resident-experts and --expert-trace (LoadOptions::resident_experts / expert_trace).
void add_expert_residency_options(CLI::App* cmd, double& resident_experts, std::string& expert_trace);

}  // namespace bg::tools

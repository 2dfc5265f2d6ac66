// Parsing helpers shared by the subcommands.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bg::tools {

// "5,17,3" -> {5, 17, 3}; spaces allowed; throws bg::Error naming the bad element.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what);

}  // namespace bg::tools

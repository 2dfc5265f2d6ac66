// Registration of the CLI subcommands (one tools/cmd_<name>.cpp each).
#pragma once

#include <CLI/CLI.hpp>

namespace bg::tools {
void register_commands(CLI::App& app);
}

// The subcommand list.
#include "tools/commands.h"

namespace bg::tools {

void register_commands(CLI::App& app) { (void)app; }

}  // namespace bg::tools

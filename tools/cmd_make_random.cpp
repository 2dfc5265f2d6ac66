// `batchgen make-random`: registration only until the random checkpoint writer lands.
#include "tools/commands.h"

namespace bg::tools {

void register_make_random(CLI::App& app) { (void)app; }

}  // namespace bg::tools

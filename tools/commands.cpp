// The subcommand list.
#include "tools/commands.h"

namespace bg::tools {

void register_commands(CLI::App& app) {
  register_score(app);
  register_generate(app);
  register_make_random(app);
  register_serve(app);
  register_worker(app);
  register_rank(app);
  register_bench_multiturn(app);
  register_tokenize(app);
  register_bench(app);
  register_weightd(app);
  register_convert(app);
}

}  // namespace bg::tools

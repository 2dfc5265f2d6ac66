// Registration of the CLI subcommands (one tools/cmd_<name>.cpp each).
#pragma once

#include <CLI/CLI.hpp>

namespace bg::tools {

void register_commands(CLI::App& app);

void register_score(CLI::App& app);
void register_generate(CLI::App& app);
void register_make_random(CLI::App& app);
void register_serve(CLI::App& app);
void register_worker(CLI::App& app);
void register_rank(CLI::App& app);
void register_bench_multiturn(CLI::App& app);
void register_tokenize(CLI::App& app);  // tokenize + detokenize
void register_bench(CLI::App& app);
void register_weightd(CLI::App& app);
void register_convert(CLI::App& app);

}  // namespace bg::tools

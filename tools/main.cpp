// batchgen CLI entry point: subcommands are registered by tools/cmd_*.cpp; parse errors come with suggestions.
#include <CLI/CLI.hpp>
#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <iostream>

#include "core/error.h"
#include "core/log.h"
#include "tools/cli_help.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  // Logs go to stderr so stdout carries only results (generated ids, text, JSON).
  spdlog::set_default_logger(spdlog::stderr_color_mt("batchgen"));
  spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug: also the debug lines (e.g. the engine's per-step timing)
  CLI::App app{"batchgen: a serving engine for Kimi-K3 and DeepSeek-V3-family MoE models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", bg::tools::version_text(), "Print the version, git commit, CUDA and NCCL "
                                                               "versions and GPU architectures of this build");
  bg::tools::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    if (rc != 0) {
      const std::vector<std::string> args(argv + 1, argv + argc);
      for (const std::string& s : bg::tools::suggestions(app, args)) std::cerr << s << "\n";
    }
    return rc;
  } catch (const bg::Error& e) {
    bg::log::error("{}", e.what());
    return 1;
  }
  return 0;
}

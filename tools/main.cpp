// batchgen CLI entry point: subcommands are registered by tools/cmd_*.cpp.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>

#include "core/error.h"
#include "core/log.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  // Logs go to stderr so stdout carries only results (generated ids, JSON).
  spdlog::set_default_logger(spdlog::stderr_color_mt("batchgen"));
  CLI::App app{"batchgen: a serving engine for Kimi-K3 and DeepSeek-V3-family MoE models"};
  app.require_subcommand(1);
  bg::tools::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const bg::Error& e) {
    bg::log::error("{}", e.what());
    return 1;
  }
  return 0;
}

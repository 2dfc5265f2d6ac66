// Logging: spdlog, one default logger (stderr). Use bg::log::info(...) etc.
#pragma once

#include <spdlog/spdlog.h>

namespace bg::log {
using spdlog::debug;
using spdlog::error;
using spdlog::info;
using spdlog::warn;
}  // namespace bg::log

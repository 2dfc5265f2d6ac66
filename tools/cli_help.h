// What the CLI adds around CLI11: the --version text, and "did you mean ...?" suggestions for mistyped flags and
// subcommands (CLI11 has no such feature: the parse error is wrapped).
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace bg::tools {

// "batchgen 0.1.0 (commit abc123)" + CUDA / NCCL versions and the compiled GPU architectures.
std::string version_text();

// The closest of `candidates` to `word` (edit distance <= max(2, |word| / 3)), or "" when none is close.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

// Suggestion lines for the arguments of argv that `app` does not know ("did you mean --max-tokens?").
std::vector<std::string> suggestions(CLI::App& app, const std::vector<std::string>& args);

}  // namespace bg::tools

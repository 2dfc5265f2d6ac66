// --version text and "did you mean" suggestions (see cli_help.h).
#include "tools/cli_help.h"

#include <fmt/format.h>

#include <algorithm>

#include "version_info.h"

#ifdef BG_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace bg::tools {

std::string version_text() {
  std::string s = fmt::format("batchgen {} (commit {})\n", BG_VERSION_STRING, BG_GIT_COMMIT);
#ifdef BG_HAVE_CUDA
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  s += fmt::format("CUDA: built with {}.{}, runtime {}.{}, driver {}\n", CUDART_VERSION / 1000,
                   (CUDART_VERSION % 1000) / 10, runtime / 1000, (runtime % 1000) / 10,
                   driver > 0 ? fmt::format("{}.{}", driver / 1000, (driver % 1000) / 10) : std::string("none found"));
  s += fmt::format("GPU architectures: sm_{}\n", BG_CUDA_ARCHS);
#else
  s += "CUDA: not built (CPU-only build: -DBG_CUDA=OFF or no nvcc at configure time)\n";
#endif
  s += "NCCL: not linked (this build has no multi-GPU exchange)";
  return s;
}

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) names.push_back("--" + n);
    for (const std::string& n : o->get_snames()) names.push_back("-" + n);
  }
  return names;
}

}  // namespace

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::vector<std::string> suggestions(CLI::App& app, const std::vector<std::string>& args) {
  std::vector<std::string> out;
  std::vector<std::string> sub_names;
  for (const CLI::App* s : app.get_subcommands({})) sub_names.push_back(s->get_name());
  CLI::App* sub = nullptr;
  for (const std::string& arg : args) {
    if (arg.empty() || arg[0] == '-') continue;
    if (std::find(sub_names.begin(), sub_names.end(), arg) != sub_names.end()) {
      sub = app.get_subcommand(arg);
    } else if (const std::string c = closest(arg, sub_names); !c.empty()) {
      out.push_back(fmt::format("'{}' is not a subcommand: did you mean '{}'?", arg, c));
    }
    break;  // only the first word names a subcommand
  }
  const std::vector<std::string> known = option_names(sub != nullptr ? *sub : app);
  for (const std::string& arg : args) {
    if (arg.size() < 2 || arg[0] != '-' || arg == "--") continue;
    const std::string flag = arg.substr(0, arg.find('='));
    if (std::find(known.begin(), known.end(), flag) != known.end()) continue;
    if (const std::string c = closest(flag, known); !c.empty()) {
      out.push_back(fmt::format("unknown option '{}': did you mean '{}'?", flag, c));
    }
  }
  return out;
}

}  // namespace bg::tools

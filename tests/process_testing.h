// Tests that run the `batchgen` CLI as a child process: run it with extra environment and its stderr in a log file,
// read the log back, and write token ids as the CLI's comma-separated lists.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "port_testing.h"

namespace bg::testing {

// Runs argv (argv[0]: the executable's path) with `env` set on top of this process's environment and its stderr
// written to `log`; returns the exit status (128 + the signal when it was killed, 127 when it could not start).
inline int run_process(const std::vector<std::string>& argv, const std::filesystem::path& log,
                       const std::vector<std::pair<std::string, std::string>>& env = {}) {
  std::vector<char*> c;
  for (const std::string& a : argv) c.push_back(const_cast<char*>(a.c_str()));
  c.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    execv(c[0], c.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

inline std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i > 0) s.push_back(',');
    s.append(std::to_string(ids[i]));
  }
  return s;
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls `cond` every 10 ms until it holds or `limit` has passed; returns its last value.
template <typename F>
bool eventually(F cond, std::chrono::milliseconds limit = std::chrono::milliseconds(5000)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

}  // namespace bg::testing

// fork/exec and reaping of child rank processes.
#include "dist/child_ranks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "core/spawn.h"

namespace bg::dist {

ChildRanks::~ChildRanks() { wait_all(std::chrono::milliseconds(0)); }

void ChildRanks::spawn(int32_t rank, const std::vector<std::string>& argv) {
  BG_CHECK(!argv.empty(), "child ranks: empty command line for rank {}", rank);
  const pid_t pid = spawn_child(argv);
  log::debug("started rank {} (pid {}): {}", rank, pid, fmt::join(argv, " "));
  children_.push_back({rank, pid, false, 0});
}

bool ChildRanks::wait_all(std::chrono::milliseconds grace) {
  auto reap_some = [&](bool block) {
    for (Child& c : children_) {
      if (c.reaped) continue;
      int status = 0;
      const pid_t r = waitpid(c.pid, &status, block ? 0 : WNOHANG);
      if (r == c.pid || (r < 0 && errno == ECHILD)) {
        c.reaped = true;
        c.status = r == c.pid ? status : 0;
      }
    }
  };
  auto all_reaped = [&] {
    for (const Child& c : children_) {
      if (!c.reaped) return false;
    }
    return true;
  };
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (reap_some(false); !all_reaped() && std::chrono::steady_clock::now() < deadline; reap_some(false)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int sig : {SIGTERM, SIGKILL}) {
    if (all_reaped()) break;
    for (const Child& c : children_) {
      if (!c.reaped) kill(c.pid, sig);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    for (reap_some(false); !all_reaped() && std::chrono::steady_clock::now() < until; reap_some(false)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  reap_some(true);
  for (const Child& c : children_) {
    if (!WIFEXITED(c.status) || WEXITSTATUS(c.status) != 0) return false;
  }
  return true;
}

bool ChildRanks::any_exited() {
  bool any = false;
  for (Child& c : children_) {
    if (!c.reaped && waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.reaped = true;
    any |= c.reaped;
  }
  return any;
}

bool ChildRanks::all_exited() const {
  for (const Child& c : children_) {
    if (!c.reaped) return false;
  }
  return true;
}

bool ChildRanks::any_failed() const {
  for (const Child& c : children_) {
    if (c.reaped && !(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0)) return true;
  }
  return false;
}

std::string ChildRanks::failures() const {
  std::string out;
  for (const Child& c : children_) {
    if (!c.reaped) continue;
    if (WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) continue;
    out += fmt::format("{}rank {} (pid {}) ", out.empty() ? "" : "; ", c.rank, c.pid);
    if (WIFEXITED(c.status)) {
      out += fmt::format("exited with status {}", WEXITSTATUS(c.status));
    } else if (WIFSIGNALED(c.status)) {
      out += fmt::format("was killed by signal {} ({})", WTERMSIG(c.status), strsignal(WTERMSIG(c.status)));
    }
  }
  return out;
}

std::vector<pid_t> ChildRanks::pids() const {
  std::vector<pid_t> out;
  for (const Child& c : children_) out.push_back(c.pid);
  return out;
}

}  // namespace bg::dist

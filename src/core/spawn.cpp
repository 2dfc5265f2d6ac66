// fork + execv with the child's descriptors closed; after fork the child calls only async-signal-safe functions.
#include "core/spawn.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace bg {

namespace {

// Closes every descriptor >= 3: close_range (Linux 5.9) when the kernel has it, else one close per possible
// descriptor up to the limit read before fork.
void close_inherited(unsigned max_fd) {
#ifdef SYS_close_range
  if (syscall(SYS_close_range, 3U, ~0U, 0U) == 0) return;
#endif
  for (unsigned fd = 3; fd < max_fd; ++fd) close(static_cast<int>(fd));
}

}  // namespace

pid_t spawn_child(const std::vector<std::string>& argv, const SpawnOptions& options) {
  BG_CHECK(!argv.empty(), "spawn: empty command line");
  // Everything the child touches is prepared before fork.
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const pid_t parent = getpid();
  sigset_t none;
  sigemptyset(&none);
  rlimit nofile{};
  const unsigned max_fd =
      getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY && nofile.rlim_cur < (1U << 20)
          ? static_cast<unsigned>(nofile.rlim_cur)
          : 1U << 16;

  const pid_t pid = fork();
  BG_CHECK(pid >= 0, "spawn: fork failed for {}: {}", argv[0], std::strerror(errno));
  if (pid == 0) {
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (options.default_sigpipe) signal(SIGPIPE, SIG_DFL);
    if (options.own_process_group) setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the parent died before prctl took effect
    close_inherited(max_fd);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
  return pid;
}

sigset_t block_stop_signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return signals;
}

}  // namespace bg

// spawn_child: the child inherits no descriptor above 2 (a client socket kept open by a worker once hung a client's
// next request), gets its argv, and exits 127 when exec fails.
#include "core/spawn.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace bg {
namespace {

int wait_status(pid_t pid) {
  int status = 0;
  EXPECT_EQ(waitpid(pid, &status, 0), pid);
  return status;
}

TEST(Spawn, ChildInheritsNoDescriptorAboveStderr) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);  // no O_CLOEXEC: a plain fork + exec would hand the write end to the child
  const pid_t pid = spawn_child({"/bin/sleep", "5"});
  close(fds[1]);
  // With the write end closed here and (if nothing leaked) in the child, the read end sees EOF at once.
  pollfd p{fds[0], POLLIN, 0};
  const int ready = poll(&p, 1, 2000);
  char c = 0;
  const ssize_t got = ready == 1 ? read(fds[0], &c, 1) : -1;
  kill(pid, SIGKILL);
  wait_status(pid);
  close(fds[0]);
  ASSERT_EQ(ready, 1) << "the child kept the pipe's write end open";
  EXPECT_EQ(got, 0) << "EOF, not data";
}

TEST(Spawn, RunsTheCommandWithItsArguments) {
  const pid_t pid = spawn_child({"/bin/sh", "-c", "exit 7"});
  const int status = wait_status(pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7);
}

TEST(Spawn, AMissingProgramExits127) {
  const pid_t pid = spawn_child({"/nonexistent/batchgen-no-such-program"});
  const int status = wait_status(pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 127);
}

TEST(Spawn, AnEmptyCommandLineIsRefused) { EXPECT_THROW(spawn_child({}), std::exception); }

}  // namespace
}  // namespace bg

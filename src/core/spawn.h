// Starting a child process (a worker, a rank of a set) with fork + execv, so that it inherits nothing but
// stdin/stdout/stderr: every other file descriptor of the parent (client sockets, the listening socket, ZeroMQ and
// shared-memory descriptors) is closed in the child before exec. A client socket that a worker kept open would
// outlive the frontend's close of it, and the client would send its next request into a socket nobody reads. Also the
// signal mask of a supervising process (block_stop_signals).
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <string>
#include <vector>

namespace bg {

struct SpawnOptions {
  bool own_process_group = false;  // setpgid(0, 0): a terminal's Ctrl-C reaches the parent only
  bool default_sigpipe = false;    // SIGPIPE back to its default action (the parent may ignore it)
};

// Forks and execs argv[0] with argv. The child unblocks every signal, gets SIGTERM when the parent dies
// (PR_SET_PDEATHSIG), closes every descriptor above 2 and exits with status 127 when exec fails. Throws when fork
// fails. Returns the child's pid.
pid_t spawn_child(const std::vector<std::string>& argv, const SpawnOptions& options = {});

// For a process that waits for SIGINT / SIGTERM with sigtimedwait on the returned set: blocks both in the calling
// thread (call it before any thread starts, so every thread inherits the mask) and ignores SIGPIPE (a peer that went
// away must not kill the process).
sigset_t block_stop_signals();

}  // namespace bg

// Free loopback TCP ports for tests that start a server process (or an in-process server) on a port of their
// choosing.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <random>

namespace bg::testing {

// Whether `port` can be bound on 127.0.0.1 now.
inline bool tcp_port_free(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// The first of `n` consecutive TCP ports on 127.0.0.1 that are free now (released: the process under test binds them
// next); 0 if none was found. They are drawn at random from outside the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), so that no outgoing connection of a test running beside this one (its
// HTTP client's source port) can take them before the process under test binds them: a port handed out by bind(0)
// is an ephemeral one, and CI once lost a test to exactly that.
inline int free_tcp_ports(int n) {
  int lo = 32768, hi = 60999;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> lo >> hi;
  int first = 10000, last = lo - n;  // below the ephemeral range, else above it
  if (last - first < 1000) first = hi + 1, last = 65535 - n;
  if (last - first < 1000) return 0;
  std::random_device rd;
  std::mt19937 rng(rd() ^ static_cast<uint32_t>(getpid()));
  std::uniform_int_distribution<int> pick(first, last);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int p = pick(rng);
    bool ok = true;
    for (int i = 0; i < n && ok; ++i) ok = tcp_port_free(p + i);
    if (ok) return p;
  }
  return 0;
}

inline int free_tcp_port() { return free_tcp_ports(1); }

}  // namespace bg::testing

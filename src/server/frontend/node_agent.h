// Node k > 0 of a serve that spans hosts (`batchgen serve ... --nnodes N --node-rank K --dist-init-addr HOST:PORT`):
// no HTTP server, only an agent. It connects to node 0's control socket (HOST:PORT), is accepted when its layout and
// rank options equal node 0's and no other agent holds its node rank, then on node 0's word starts this node's
// `batchgen worker` processes (ranks K·n .. K·n + n − 1) for an incarnation of the set, kills them, and reports each
// start and exit. It exits after stopping and reaping every worker: 0 on node 0's goodbye or SIGINT/SIGTERM, an
// error when node 0 refuses it, never answers (BG_RANK_TIMEOUT_S) or falls silent (--node-timeout).
#pragma once

#include "server/frontend/serve.h"

namespace bg::frontend {

// Runs the agent until it is done; returns the exit code (0), throws bg::Error with the reason otherwise.
int run_node_agent(const ServeOptions& opt);

}  // namespace bg::frontend

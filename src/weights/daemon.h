// weightd: one daemon per node and store. It holds the store's lock, answers the control channel (status, attach,
// detach, shutdown) on its main thread while a loader thread adopts the existing shared-memory store (after
// verifying every checksum) or builds it from the checkpoint (this node's share of it, plus what it fetches from its
// peers with --fetch-missing), and serves its tensors to peers (UCX) when a distributed config names this node.
#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include "weights/store_builder.h"

namespace bg::weights {

// An adopted store whose tensors no longer match their checksums: re-read them, or refuse to start.
enum class OnCorrupt { kReload, kRefuse };

struct DaemonOptions {
  std::filesystem::path model_dir;
  std::string name;
  OnCorrupt on_corrupt = OnCorrupt::kReload;
  BuildOptions build;
  int verify_threads = 0;                  // 0: hardware threads
  std::filesystem::path distributed_config;  // empty: a single-node store
  std::string node;                        // this daemon's node in the distributed config
  bool fetch_missing = false;              // fetch the tensors of other nodes' shards into this store
  int progress_tty = -1;
  bool handle_signals = true;              // SIGINT/SIGTERM stop the daemon (off for in-process tests)
};

class WeightDaemon {
 public:
  explicit WeightDaemon(DaemonOptions options);
  ~WeightDaemon();
  WeightDaemon(const WeightDaemon&) = delete;
  WeightDaemon& operator=(const WeightDaemon&) = delete;

  // Runs until a shutdown request, a signal or request_stop(). `on_ready` is called once, with "" when the store is
  // ready or with the error when loading failed (then run returns 1 at once). Throws when the store's lock or
  // control socket cannot be taken (another daemon of that name runs).
  int run(const std::function<void(const std::string& error)>& on_ready);
  // Asks run() to return (thread-safe); the segments stay unless remove_segments.
  void request_stop(bool remove_segments);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace bg::weights

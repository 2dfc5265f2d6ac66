// The parallel-layout flags of every command (vLLM/SGLang style: --tp/--dp/--ep and their -size forms, --nnodes,
// --node-rank, --dist-init-addr, --k3-moe-exchange) and, for the single-process CLIs (score, generate), the rank set:
// this process is rank 0, the other ranks of its node run as `batchgen rank` children, the ranks of other nodes are
// children of the same command run there, and rank 0's output is the result.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "dist/child_ranks.h"
#include "dist/parallel_layout.h"
#include "dist/rank_context.h"
#include "model/model.h"

namespace bg::tools {

struct ParallelArgs {
  int32_t tp = 0, dp = 0, ep = 0;  // 0: not given (derived)
  int32_t nnodes = 1, node_rank = 0;
  std::string dist_init_addr;      // host:port on node 0 for several nodes (score/generate: the rendezvous; serve:
                                   // the node control socket, and the worker link on the next port)
  std::string node_secret_file;    // --node-secret-file: authenticates the links between nodes (link_key.h)
  std::string exchange = "nccl";   // --k3-moe-exchange
  int64_t max_tokens_per_call = 0; // --moe-exchange-tokens (0: the exchange's default)

  dist::ParallelFlags flags() const;
  dist::ParallelLayout layout() const { return dist::ParallelLayout::from_flags(flags()); }
};

// Adds the flags to `cmd`; with_nodes adds --nnodes / --node-rank / --dist-init-addr / --node-secret-file.
void add_parallel_flags(CLI::App* cmd, ParallelArgs& args, bool with_nodes);
// With --nnodes > 1 and no --node-secret-file: a warning that the links between nodes are not authenticated.
void warn_if_unauthenticated(const ParallelArgs& args);

// The ranks of a single-process CLI on this host.
class LocalRanks {
 public:
  // The state every rank builds (make_state): TP ranks mirror rank 0's pools, so all build the same.
  struct StateSize {
    int64_t max_sequences = 1;
    int64_t max_tokens = 0;
  };
  // One rank: returns null (the model runs alone). Otherwise spawns ranks 1.. (each loads the model with `options`:
  // device and weight source, and builds `state`) and joins the set as rank 0; the returned object's context() goes
  // into LoadOptions::ranks.
  static std::unique_ptr<LocalRanks> start(const ParallelArgs& args, const std::filesystem::path& model_dir,
                                           const LoadOptions& options, StateSize state);
  // Several nodes (--nnodes > 1): every node runs the same command with its --node-rank. Node 0 runs rank 0 (start,
  // above: its rendezvous binds --dist-init-addr) and prints the result; node k > 0 only runs its ranks as children
  // (run_node) until rank 0 stops the set, and throws naming a rank of it that failed.
  static bool runs_on_other_node(const ParallelArgs& args);
  static void run_node(const ParallelArgs& args, const std::filesystem::path& model_dir, const LoadOptions& options);
  ~LocalRanks();
  std::shared_ptr<dist::RankContext> context() const { return ctx_; }
  // After the work: every rank stops (the children leave their loop and exit 0); throws naming a child that failed.
  void finish(Model& model);

 private:
  LocalRanks() = default;
  std::filesystem::path dir_;
  dist::ChildRanks children_;
  std::shared_ptr<dist::RankContext> ctx_;
};

}  // namespace bg::tools

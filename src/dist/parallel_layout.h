// The parallel layout of a rank set: how many ranks (the world), how they group into data-parallel attention groups
// with tensor parallelism inside each group, and where one rank sits. Experts are spread over every rank (EP = world).
// Flags follow vLLM/SGLang names (docs/PARALLEL.md): --tp, --dp, --ep, --nnodes, --node-rank.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace bg::dist {

// Upper bound on ranks in one set (the shared-memory segment and rank ids are sized for it).
inline constexpr int32_t kMaxRanks = 64;

// What the user asked for; unset fields are derived (ParallelLayout::from_flags).
struct ParallelFlags {
  std::optional<int32_t> tp;   // attention tensor parallelism inside a DP group
  std::optional<int32_t> dp;   // data-parallel attention groups
  std::optional<int32_t> ep;   // expert parallelism: the ranks the routed experts are spread over (= world)
  int32_t nnodes = 1;          // hosts the world spans (ranks split evenly, node k holds a contiguous range)
  int32_t node_rank = 0;       // this host
};

class ParallelLayout {
 public:
  ParallelLayout() = default;
  // world = ep when given, else dp x tp; tp defaults to 1 and dp to world / tp. Throws bg::Error naming the flags
  // that disagree (dp x tp != ep, a world that nnodes does not divide, ...).
  static ParallelLayout from_flags(const ParallelFlags& flags);
  // A single rank (no parallelism).
  static ParallelLayout single() { return ParallelLayout(); }

  int32_t world() const { return dp_ * tp_; }
  int32_t dp() const { return dp_; }
  int32_t tp() const { return tp_; }
  int32_t ep() const { return world(); }
  int32_t nnodes() const { return nnodes_; }
  int32_t ranks_per_node() const { return world() / nnodes_; }
  bool multi_rank() const { return world() > 1; }
  // Rank r sits in DP group r / tp at TP rank r % tp; TP rank 0 of a group (its leader) schedules the group.
  int32_t dp_group(int32_t rank) const { return rank / tp_; }
  int32_t tp_rank(int32_t rank) const { return rank % tp_; }
  int32_t leader_of(int32_t group) const { return group * tp_; }
  bool is_leader(int32_t rank) const { return tp_rank(rank) == 0; }
  int32_t node_of(int32_t rank) const { return rank / ranks_per_node(); }
  // The ranks node k starts: [first_rank_of(k), first_rank_of(k) + ranks_per_node()).
  int32_t first_rank_of(int32_t node) const { return node * ranks_per_node(); }
  // "dp=2 tp=2 ep=4 (4 ranks)".
  std::string describe() const;

 private:
  int32_t dp_ = 1, tp_ = 1, nnodes_ = 1;
};

// Where this process sits in a layout.
struct RankPlace {
  ParallelLayout layout;
  int32_t rank = 0;
  int32_t dp_group() const { return layout.dp_group(rank); }
  int32_t tp_rank() const { return layout.tp_rank(rank); }
  bool is_leader() const { return layout.is_leader(rank); }
};

// "host:port" -> {host, port}; throws naming the flag on a malformed value.
struct HostPort {
  std::string host;
  int port = 0;
};
HostPort parse_host_port(const std::string& text, const std::string& flag);

}  // namespace bg::dist

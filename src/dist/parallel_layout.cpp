// Parallel layout: derivation and validation of --tp / --dp / --ep / --nnodes.
#include "dist/parallel_layout.h"

#include <fmt/format.h>

#include <charconv>

#include "core/error.h"

namespace bg::dist {

ParallelLayout ParallelLayout::from_flags(const ParallelFlags& f) {
  auto positive = [](const std::optional<int32_t>& v, const char* flag) {
    BG_CHECK(!v || (*v >= 1 && *v <= kMaxRanks), "{} {} must be in [1, {}]", flag, v.value_or(0), kMaxRanks);
  };
  positive(f.tp, "--tp");
  positive(f.dp, "--dp");
  positive(f.ep, "--ep");
  // --dp 2 --ep 4 leaves tp to be derived: 4 / 2 = 2 ranks of attention TP per group.
  int32_t tp = f.tp.value_or(1);
  if (!f.tp && f.ep && f.dp && *f.dp <= *f.ep && *f.ep % *f.dp == 0) tp = *f.ep / *f.dp;
  const int32_t world = f.ep ? *f.ep : f.dp.value_or(1) * tp;
  BG_CHECK(world >= 1 && world <= kMaxRanks, "--dp {} x --tp {} = {} ranks; at most {} are supported",
           f.dp.value_or(1), tp, world, kMaxRanks);
  BG_CHECK(world % tp == 0, "--tp {} does not divide the {} ranks of --ep {}: every DP group needs --tp ranks", tp,
           world, world);
  const int32_t dp = f.dp.value_or(world / tp);
  BG_CHECK(dp * tp == world, "--dp {} x --tp {} = {} ranks, but --ep {} spreads the experts over {} ranks; experts "
           "are spread over every rank, so --ep must equal --dp x --tp (or be left out)", dp, tp, dp * tp, world,
           world);
  BG_CHECK(f.nnodes >= 1 && f.nnodes <= world, "--nnodes {} must be in [1, {}] (the number of ranks)", f.nnodes,
           world);
  BG_CHECK(world % f.nnodes == 0, "--nnodes {} does not divide the {} ranks evenly", f.nnodes, world);
  BG_CHECK(f.node_rank >= 0 && f.node_rank < f.nnodes, "--node-rank {} must be in [0, {})", f.node_rank, f.nnodes);
  ParallelLayout l;
  l.dp_ = dp;
  l.tp_ = tp;
  l.nnodes_ = f.nnodes;
  return l;
}

std::string ParallelLayout::describe() const {
  return fmt::format("dp={} tp={} ep={} ({} rank{}{})", dp_, tp_, ep(), world(), world() == 1 ? "" : "s",
                     nnodes_ == 1 ? "" : fmt::format(" on {} nodes", nnodes_));
}

HostPort parse_host_port(const std::string& text, const std::string& flag) {
  const size_t colon = text.rfind(':');
  BG_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < text.size(), "{} '{}' must be host:port", flag,
           text);
  HostPort hp;
  hp.host = text.substr(0, colon);
  if (hp.host.size() > 2 && hp.host.front() == '[' && hp.host.back() == ']') hp.host = hp.host.substr(1, hp.host.size() - 2);
  const char* b = text.data() + colon + 1;
  const char* e = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(b, e, hp.port);
  BG_CHECK(ec == std::errc() && ptr == e && hp.port >= 1 && hp.port <= 65535, "{} '{}': port must be in [1, 65535]",
           flag, text);
  return hp;
}

}  // namespace bg::dist

// Micro-benchmark of the W4A16 expert kernel at Kimi-K3 decode shapes: GB/s on packed weight bytes and the fraction of
// a read ceiling measured in the same run. Small on purpose, so it can move into the `batchgen bench` kernel registry.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace bg::ops {

struct MoeW4a16BenchConfig {
  std::vector<int> rows_per_expert = {1, 4, 16, 32};
  int64_t n_slots = 56;  // local experts of one EP16 rank
  int64_t touched = 16;  // experts with rows (every token picks the same 16, rotated per launch)
  int64_t hidden = 3584;
  int64_t inter = 3072;
  int copies = 8;        // launches per CUDA graph, each on a different set of experts
  int replays = 5;       // timed graph replays; the median is reported
  // Top-k routing as in `bench kernels`: rows_per_expert are then token counts, each token picking `touched`
  // distinct experts of n_slots at random (a fixed seed per launch); bytes count the experts a launch touches.
  bool random_routing = false;
};

struct MoeW4a16BenchRow {
  int rows_per_expert = 0;  // tokens with random_routing
  double experts = 0.0;      // touched experts per launch (average)
  bool pdl = false;  // down launched as a programmatic dependent of gate/up
  bool wgmma = false;  // the tensor-core step on wgmma (MoeW4a16Params::wgmma)
  bool narrow = false;  // two CTAs per SM (MoeW4a16Params::narrow; rows <= 64)
  int splits_gate_up = 0, splits_down = 0;  // the split-K factors the kernel picks
  double us = 0.0;                          // per launch (both kernels)
  double gbps = 0.0;                        // packed weight bytes (codes + scales) per second
  double fraction = 0.0;                    // of the read ceiling
};

struct MoeW4a16BenchResult {
  std::string device;
  double read_ceiling_gbps = 0.0;  // uint4 grid-stride read over the expert allocation (> L2)
  double bytes_per_expert = 0.0;  // packed gate/up + down
  std::vector<MoeW4a16BenchRow> rows;
};

// Needs a CUDA device; allocates n_slots experts of random MXFP4 (about 1 GB for Kimi-K3).
MoeW4a16BenchResult moe_w4a16_bench_k3(const MoeW4a16BenchConfig& cfg);
std::string moe_w4a16_bench_table(const MoeW4a16BenchResult& r);

}  // namespace bg::ops

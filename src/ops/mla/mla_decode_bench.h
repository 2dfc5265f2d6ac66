// MLA decode micro-benchmark: times mla_decode_cuda at K3 shapes as the median of graph replays (many launches per
// graph, inputs rotated past the L2), next to a read ceiling measured in the same run. Small on purpose, so that
// `batchgen bench` (src/bench/) can take it over.
#pragma once

#include <cstdint>
#include <vector>

#include "ops/mla/mla_decode_plan.h"

namespace bg::ops {

struct MlaDecodeBenchCase {
  int64_t batch = 1;
  int64_t context = 4096;  // every sequence's context length
};

struct MlaDecodeBenchOptions {
  int64_t n_heads = 96, qk_nope = 128, v_head = 128, block_size = 64;  // Kimi-K3
  std::vector<MlaDecodeBenchCase> cases = {{1, 4096}, {16, 4096}, {64, 4096}, {1, 32768}, {16, 32768}, {64, 32768}};
  std::vector<MlaDecodeMma> mmas = {MlaDecodeMma::kMmaSync, MlaDecodeMma::kWgmma, MlaDecodeMma::kWgmmaHeadsM};
  int64_t rotate_bytes = int64_t{256} << 20;  // input copies until their bytes exceed this (4x the 60 MB L2)
  int replays = 5;
};

struct MlaDecodeBenchResult {
  MlaDecodeBenchCase c;
  MlaDecodeMma mma = MlaDecodeMma::kMmaSync;
  double us = 0;          // one launch of the op (all five kernels), median of replays
  double kv_tbps = 0;     // cache bytes read per second
  double tflops = 0;      // attention + absorption FLOPs per second
  double read_fraction = 0;  // kv_tbps / the measured read ceiling
  double all_bytes_fraction = 0;  // (cache + W_UK + W_UV + q + out bytes) / us / ceiling: the op's roofline share
  double attention_us = 0;   // the attention kernel alone (no GEMMs, prep or combine)
  double attention_read_fraction = 0;  // cache bytes / attention_us / ceiling: the kernel's figure of merit
  int registers = 0;
  int64_t smem_bytes = 0, spill_bytes = 0;
};

// Device read ceiling in TB/s: a uint4 grid-stride read over 2 GiB, median of 5.
double mla_decode_bench_read_ceiling_tbps();

// Runs every case for every MMA policy and prints one table row each (stdout).
std::vector<MlaDecodeBenchResult> mla_decode_bench(const MlaDecodeBenchOptions& options);

}  // namespace bg::ops

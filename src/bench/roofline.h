// The bytes and FLOPs a model step must move and do, from the checkpoint (every weight as stored: dense, FP8, MXFP4
// with its scales) and the config (which layers are MLA, KDA, MoE; attention dims), and the roofline time they imply
// on measured ceilings: the sum over ops of max(bytes / read, FLOPs / compute). Elementwise ops and activations
// between ops are left out (they are small next to weights, KV and state, and a fused design removes most of them).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "bench/bench_report.h"

namespace bg::bench {

struct StepCost {
  double bytes = 0;
  double flops = 0;
  double roofline_ms = 0;  // sum over ops of max(bytes / read, flops / compute)
  void add(double op_bytes, double op_flops, const Ceilings& c);
};

class StepCostModel {
 public:
  // Reads config.json and binds the checkpoint's weights (mmap; nothing is decoded). act_bytes: bytes per activation
  // and MLA cache value on the device (2 for CUDA's bf16, 4 for the CPU's fp32).
  static StepCostModel load(const std::filesystem::path& dir, int64_t act_bytes);

  // A decode step: `batch` sequences of one token each, every sequence holding `context` tokens before it;
  // touched[i] = routed experts with rows in the i-th MoE layer (measured; empty = all experts of the layer).
  StepCost decode_step(int64_t batch, int64_t context, std::span<const double> touched, const Ceilings& c) const;
  // One prefill chunk of one sequence: tokens [start, start + n). Experts touched are the expectation under uniform
  // routing; attention FLOPs are causal attention's (2 * heads * (qk + v) per query-key pair, what a FlashAttention
  // kernel does), counted over the chunk's queries against the prefix and the chunk.
  StepCost prefill_chunk(int64_t start, int64_t n, const Ceilings& c) const;

  int64_t n_moe_layers() const { return static_cast<int64_t>(moe_.size()); }
  int64_t vocab() const { return vocab_; }
  const std::string& arch() const { return arch_; }

 private:
  struct Linear {
    int64_t n_out = 0, n_in = 0;
    double weight_bytes = 0;
  };
  struct Moe {
    int64_t n_experts = 0, top_k = 0;
    int64_t in_dim = 0, out_dim = 0;  // expert input / output width
    double expert_bytes = 0;          // gate + up + down of one expert, as stored
    double expert_params = 0;         // their elements (FLOPs per row = 2 * params)
  };
  struct Mla {
    int64_t heads = 0, kv_lora = 0, rope = 0, nope = 0, v = 0;
  };
  struct Kda {
    int64_t heads = 0, head_dim = 0, conv_channels = 0, conv_width = 0;
  };

  double linear_cost(const Linear& l, int64_t rows, const Ceilings& c, StepCost& cost) const;

  std::string arch_;
  int64_t act_bytes_ = 2, hidden_ = 0, vocab_ = 0;
  std::vector<Linear> dense_;  // every linear but the routed experts and the lm_head
  Linear lm_head_;
  std::vector<Moe> moe_;
  std::vector<Mla> mla_;
  std::vector<Kda> kda_;
};

}  // namespace bg::bench

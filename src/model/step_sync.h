// What the ranks of a set agree on before every step: whether anyone has work or wants to stop, the largest batch
// (so CUDA-graph buckets match), the most MoE tokens on any rank (so every rank makes the same number of exchange
// rounds) and whether anyone prefills (then nobody replays a decode graph). Plus the wire form of a StepLayout that
// a DP group's leader sends its TP followers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "dist/comm.h"

namespace bg {

struct StepVote {
  bool stop = false;        // this rank is shutting down: the whole set stops
  int64_t n_seqs = 0;       // sequences this rank's group runs (0: no work)
  int64_t moe_tokens = 0;   // tokens this rank dispatches per MoE layer
  bool prefill = false;     // some sequence has more than one token
};

struct StepAgreement {
  bool stop = false;
  bool any_work = false;
  int64_t max_seqs = 0;
  int64_t max_moe_tokens = 0;
  bool any_prefill = false;
};

// One all-reduce (max) over the world.
StepAgreement agree_step(dist::Comm& world, const StepVote& mine);

// StepLayout + the all-rows flag as bytes and back (decode validates every size).
std::vector<std::byte> encode_step(const StepLayout& step, bool all_rows);
StepLayout decode_step(std::span<const std::byte> bytes, bool* all_rows);

}  // namespace bg

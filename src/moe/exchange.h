// The expert-parallel exchange of one MoE layer: dispatch sends each routed (token, k) pair's input row to the rank
// that holds its expert, grouped there by local slot; combine brings the expert outputs back and accumulates
// sum_k w(t,k) y(t,k) into each token's output on its own rank. Begin/finish pairs let the caller run independent work
// (the shared experts) while rows are in flight. One implementation per transport: loopback (one rank, any backend),
// CPU shared memory, NCCL all-to-all, and the low-latency exchange; each is tested against the loopback.
#pragma once

#include <algorithm>
#include <memory>
#include <string_view>

#include "backend/backend.h"
#include "moe/expert_table.h"

namespace bg::moe {

// What a MoE layer hands the exchange: the router's choices and the rows to send (act dtype, backend memory).
struct DispatchInput {
  const Tensor* ids = nullptr;      // I32 [n_tokens, top_k] global expert ids
  const Tensor* weights = nullptr;  // F32 [n_tokens, top_k]
  const Tensor* x = nullptr;        // [n_tokens, hidden] expert inputs
};

// The rows this rank's experts process: routing (grouping by local slot) and the row buffers.
struct ExpertRows {
  MoeRouting routing;
  Tensor x;       // [capacity, hidden] act: inputs grouped by slot (routing.offsets)
  Tensor y;       // [capacity, hidden] act: the experts' outputs, same rows
  Tensor origin;  // I32 [capacity] (exchanges between ranks): where each row's output goes back
};

class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual std::string_view name() const = 0;
  virtual int64_t n_ranks() const = 0;
  virtual int64_t rank() const = 0;
  // Tokens one dispatch can carry per rank (0: any number). moe_routed sends more in rounds; every rank makes the
  // same number of rounds per layer (step_rounds), so a rank with fewer tokens sends empty rounds.
  virtual int64_t max_tokens_per_call() const { return 0; }
  // Called before each step with the most MoE tokens any rank has in it (the step agreement).
  void set_step_tokens(int64_t max_tokens_any_rank) { step_tokens_ = max_tokens_any_rank; }
  // The most MoE tokens any rank has in this step (0 before the first set_step_tokens).
  int64_t step_tokens() const { return step_tokens_; }
  // Dispatch/combine rounds every rank makes per MoE layer in this step.
  int64_t step_rounds() const {
    const int64_t per = max_tokens_per_call();
    return per == 0 ? 1 : std::max<int64_t>(1, (step_tokens_ + per - 1) / per);
  }
  // True when every expert is on this rank and no rows move (the loopback): the layer then runs gather, experts and
  // combine as one backend op (Backend::moe_routed_local), which backends may fuse.
  virtual bool local() const { return false; }
  // True when dispatch and combine can be captured in a CUDA graph (no host synchronisation inside). The nccl and shm
  // exchanges are not; a rank set with one runs its steps eagerly.
  virtual bool capturable() const { return false; }
  // Starts the dispatch of `in` under `table` (this rank's slots); rows.x / rows.routing are valid after
  // finish_dispatch. rows.y is allocated for the experts to fill. `in` may hold no tokens (the rank still takes
  // part: it receives rows for its experts).
  virtual void begin_dispatch(Backend& be, const ExpertTable& table, const DispatchInput& in, ExpertRows& rows) = 0;
  virtual void finish_dispatch(Backend& be, ExpertRows& rows) = 0;
  // Starts returning rows.y to the pairs' ranks; after finish_combine, out[t] += sum_k w(t,k) y(t,k) (fp32, k order)
  // for every pair of this rank's tokens. out: [n_tokens, hidden] act.
  virtual void begin_combine(Backend& be, const ExpertRows& rows, Tensor& out) = 0;
  virtual void finish_combine(Backend& be, Tensor& out) = 0;
  // The rank set agreed to stop (no dispatch or combine follows and the peers are about to exit): an exchange that
  // watches its peers stops watching, so their normal exit is not reported as a failure.
  virtual void quiesce() {}

 private:
  int64_t step_tokens_ = 0;
};

// One rank: every expert is local. Dispatch = moe_dispatch + moe_gather, combine = moe_combine (no copies between
// ranks); works on every backend.
std::unique_ptr<Exchange> make_loopback_exchange();

}  // namespace bg::moe

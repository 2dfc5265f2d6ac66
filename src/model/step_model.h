// StepModel: the step driver both architectures share. It lays a batch out (forward_common), runs the architecture's
// step body on the backend's current step over the pools the batch's sequences live in — eagerly, or for decode steps
// on CUDA as a graph captured once per (bucketed batch size, block-table width) and replayed — then downloads the
// logits (forward_batch) or samples them in backend memory (forward_batch_sample), and advances the sequences.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <tuple>

#include "backend/backend.h"
#include "model/forward_common.h"
#include "model/model.h"
#include "moe/exchange.h"
#include "moe/expert_table.h"

namespace bg {

class StepModel : public Model {
 public:
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) final;
  void forward_batch(std::span<const BatchEntry> batch, float* last_logits) final;
  void forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                            std::span<ops::RowSample> out) final;
  int64_t n_graphs_captured() const final { return backend().n_graphs(); }

 protected:
  explicit StepModel(const LoadOptions& options);
  // The architecture's ops over backend().step() and the sequences' pools: logits F32, one row per token when
  // all_rows, else one row per sequence (its last token). Must not synchronise when tap is null and no route hook is
  // set (graph capture).
  virtual Tensor step_body(const StepPools& pools, bool all_rows, const TapFn* tap) = 0;
  // The MoE layers' exchange (loopback on one rank) and where each expert lives.
  moe::Exchange& exchange() const { return *exchange_; }
  moe::ExpertPlacement placement(int64_t n_experts) const;

 private:
  // The step's last-token logits F32 [batch.size(), vocab] in backend memory (graph-owned when replayed); the
  // sequences advance only in finish_step, after the caller has read them.
  Tensor run_batch(std::span<const BatchEntry> batch);
  int64_t graph_pools_index(const StepPools& pools);
  std::unique_ptr<moe::Exchange> exchange_;
  bool graphs_;
  int64_t max_graph_batch_;
  std::map<std::tuple<const void*, const void*, int64_t>, int64_t> graph_pools_;
};

// The final projection of a step: x [n_tokens, hidden] (normed) -> logits F32 [n_tokens or n_seqs, vocab].
Tensor lm_head_logits(Backend& be, const LinearHandle& lm_head, const Tensor& x, bool all_rows);

}  // namespace bg

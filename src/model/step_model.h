// StepModel: the step driver both architectures share. It lays a batch out (forward_common), runs the architecture's
// step body on the backend's current step over the pools the batch's sequences live in — eagerly, or for decode steps
// on CUDA as a graph captured once per (bucketed batch size, block-table width) and replayed — then downloads the
// logits (forward_batch) or samples them in backend memory (forward_batch_sample), and advances the sequences. As
// one rank of a set (LoadOptions::ranks) every step is first agreed with the other ranks (step_sync.h), a DP group's
// leader sends its layout to its TP followers, and a rank without work runs a padding-only step on its own pools, so
// the collectives of tensor parallelism and the expert exchange always meet.
#pragma once

#include <map>
#include <memory>
#include <span>
#include <utility>
#include <tuple>

#include "backend/backend.h"
#include "dist/rank_context.h"
#include "model/forward_common.h"
#include "model/model.h"
#include "model/tp_shard.h"
#include "moe/exchange.h"
#include "moe/expert_stream.h"
#include "moe/expert_table.h"

namespace bg {

class StepModel : public Model {
 public:
  void forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) final;
  void forward_batch(std::span<const BatchEntry> batch, float* last_logits) final;
  void forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                            std::span<ops::RowSample> out) final;
  int64_t n_graphs_captured() const final { return backend().n_graphs(); }
  bool collective() const final { return ranks_ != nullptr && ranks_->world_size() > 1; }
  bool sync_idle(bool stop, const StepPools& pools) final;
  // The streamed-expert pool and its counters (null when every expert is resident).
  const moe::ExpertStream* expert_stream() const { return expert_stream_.get(); }
  ExpertStreamCounters expert_stream_counters() const final;

 protected:
  explicit StepModel(const LoadOptions& options);
  // The architecture's ops over backend().step() and the sequences' pools: logits F32, one row per token when
  // all_rows, else one row per sequence (its last token); with TP, lm_head_logits' gathered form. Must not
  // synchronise when tap is null and no route hook is set (graph capture).
  virtual Tensor step_body(const StepPools& pools, bool all_rows, const TapFn* tap) = 0;

  // Builds the MoE exchange once the expert geometry is known: loopback on one rank, else the rank context's
  // (collective: every rank calls it at the same point of loading).
  void init_exchange(int64_t n_experts, int64_t top_k, int64_t expert_hidden);
  moe::Exchange& exchange() const { return *exchange_; }
  moe::ExpertPlacement placement(int64_t n_experts) const;
  // Which experts stay resident (LoadOptions::resident_experts / expert_trace); every expert when 1.
  moe::ExpertResidency plan_residency(const moe::ExpertPlacement& placement) const;
  // A MoE layer's streamed experts: this rank's non-resident ones with their host bytes (source(expert) -> gate, up,
  // down), through the model's pool of expert buffers (made on the first streamed layer, one layer's worth of
  // buffers). Empty when every expert is resident.
  // Pins the host bytes of every streamed expert noted by streamed_experts (call once, after the last layer), so that
  // the copies run at the DMA rate from the first step on.
  void pin_streamed_experts();
  moe::StreamedExperts streamed_experts(const moe::ExpertResidency& residency, const moe::ExpertPlacement& placement,
                                        int64_t layer,
                                        const std::function<moe::ExpertSource(int32_t expert)>& source);

  // Tensor parallelism inside this rank's DP group (1 / 0 without).
  int32_t tp_size() const { return ranks_ ? ranks_->tp_size() : 1; }
  int32_t tp_rank() const { return ranks_ ? ranks_->tp_rank() : 0; }
  // A TP slice of the split dimension: LinearShare for linears (kRows / kCols), or kAll without TP.
  LinearShare tp_share(ShareKind kind) const { return {tp_size() > 1 ? kind : ShareKind::kAll, tp_size(), tp_rank()}; }
  // Sums a row-parallel output (o_proj, down) over the TP ranks; no-op without TP.
  void tp_all_reduce(Tensor& t) const;
  // The rows [first, first + count) of a step's n tokens whose routed experts this TP rank dispatches (all without
  // TP); the other TP ranks take the other rows, and the all-reduce after the FFN joins them.
  std::pair<int64_t, int64_t> moe_rows(int64_t n) const;
  // The final projection: x [n_tokens, hidden] (normed) -> logits F32 [n_tokens or n_seqs, vocab]. With TP, lm_head
  // holds this rank's vocab slice and the result is [tp, rows, vocab / tp] (gathered; unpacked after download).
  Tensor lm_head_logits(const LinearHandle& lm_head, const Tensor& x, bool all_rows) const;

 private:
  void forward_single(std::span<const BatchEntry> batch, bool all_rows, float* logits, const TapFn* tap);
  // Lays out and runs one rank's step (a graph or eagerly); returns its logits in backend memory (graph-owned when
  // replayed; padding rows past *n_rows) — the sequences advance only in finish_step, after the caller read them.
  Tensor run_single(std::span<const BatchEntry> batch, bool all_rows, const TapFn* tap, int64_t* n_rows);
  bool forward_ranks(std::span<const BatchEntry> batch, const StepPools& pools, bool all_rows, float* logits,
                     const TapFn* tap, bool stop);
  // Runs a laid-out step (graph or eager); the logits stay in backend memory.
  Tensor run_layout(StepLayout step, const StepPools& pools, int64_t bucket, bool all_rows, const TapFn* tap);
  int64_t graph_pools_index(const StepPools& pools);

  std::shared_ptr<dist::RankContext> ranks_;
  std::unique_ptr<moe::Exchange> exchange_;
  double resident_experts_;
  std::string expert_trace_;
  std::unique_ptr<moe::ExpertStream> expert_stream_;
  bool graphs_;
  int64_t max_graph_batch_;
  std::map<std::tuple<const void*, const void*, int64_t>, int64_t> graph_pools_;
};

}  // namespace bg

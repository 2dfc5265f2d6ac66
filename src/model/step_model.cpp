// StepModel: eager and CUDA-graph steps over the architecture's step body.
#include "model/step_model.h"

#include <bit>
#include <tuple>

#include "core/error.h"

namespace bg {

StepModel::StepModel(const LoadOptions& options)
    : exchange_(moe::make_loopback_exchange()), graphs_(options.cuda_graphs), max_graph_batch_(options.max_graph_batch) {
  BG_CHECK(max_graph_batch_ >= 1 && std::has_single_bit(static_cast<uint64_t>(max_graph_batch_)),
           "max_graph_batch must be a power of two >= 1, got {}", max_graph_batch_);
}

moe::ExpertPlacement StepModel::placement(int64_t n_experts) const {
  return moe::ExpertPlacement::contiguous(n_experts, exchange_->n_ranks(), exchange_->rank());
}

void StepModel::forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) {
  if (tokens.empty()) return;
  const BatchEntry entry{&seq, tokens};
  Backend& be = backend();
  const StepPools pools = step_pools_of({&entry, 1});
  be.begin_step(layout_step({&entry, 1}, info(), pools));
  Tensor out = step_body(pools, true, tap);
  be.download_f32(out, logits);
  finish_step({&entry, 1});
}

void StepModel::forward_batch(std::span<const BatchEntry> batch, float* last_logits) {
  const Tensor out = run_batch(batch);
  backend().download_f32(out, last_logits);
  finish_step(batch);
}

void StepModel::forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                                     std::span<ops::RowSample> out) {
  const Tensor logits = run_batch(batch);
  backend().sample_rows(logits, rows, out);
  finish_step(batch);
}

Tensor StepModel::run_batch(std::span<const BatchEntry> batch) {
  Backend& be = backend();
  const StepPools pools = step_pools_of(batch);
  StepLayout step = layout_step(batch, info(), pools);
  const int64_t n = step.n_seqs();
  // Decode steps on CUDA replay a graph of the next power-of-two batch (padding sequences write only the pools'
  // padding block and slot). A route hook synchronises, so it forces eager steps; so does a per-op profiler.
  const bool per_op_profile = be.profiler() != nullptr && be.profiler()->per_op();
  const bool graph_ok =
      graphs_ && !route_hook_ && !per_op_profile && be.device() == DeviceKind::kCuda && step.all_single_token();
  const int64_t bucket = graph_ok ? graph_bucket(n, max_graph_batch_) : 0;
  Tensor out;
  if (bucket > 0) {
    pad_decode_step(step, bucket, pools);
    const int64_t key = (graph_pools_index(pools) << 48) | (bucket << 32) | step.max_blocks;
    be.begin_step(std::move(step));
    out = be.run_graph(key, [this, &pools] { return step_body(pools, false, nullptr); }).rows_view(0, n);
  } else {
    be.begin_step(std::move(step));
    out = step_body(pools, false, nullptr);
  }
  return out;
}

// A captured graph bakes in the pools' addresses and block size: graphs are keyed by them too, so sequences of
// another kv::StateManager never replay a graph of this one.
int64_t StepModel::graph_pools_index(const StepPools& pools) {
  const auto id = std::make_tuple(pools.kv->storage().data, pools.state ? pools.state->storage().data : nullptr,
                                  pools.kv->block_size());
  auto it = graph_pools_.find(id);
  if (it == graph_pools_.end()) it = graph_pools_.emplace(id, static_cast<int64_t>(graph_pools_.size())).first;
  BG_CHECK(it->second < (int64_t{1} << 15), "cuda graphs: too many distinct state pools");
  return it->second;
}

Tensor lm_head_logits(Backend& be, const LinearHandle& lm_head, const Tensor& x, bool all_rows) {
  const StepLayout& s = be.step();
  if (all_rows || s.all_single_token()) {
    Tensor out = be.alloc({x.rows(), lm_head.n_out()}, DType::kF32);  // [n_tokens, vocab]
    be.linear(lm_head, x, out);
    return out;
  }
  Tensor last = be.act(s.n_seqs(), x.cols());  // [n_seqs, hidden]
  be.gather_last_rows(x, last);
  Tensor out = be.alloc({s.n_seqs(), lm_head.n_out()}, DType::kF32);  // [n_seqs, vocab]
  be.linear(lm_head, last, out);
  return out;
}

}  // namespace bg

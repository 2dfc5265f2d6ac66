// StepModel: eager and CUDA-graph steps over the architecture's step body, alone or as one rank of a set.
#include "model/step_model.h"

#include <bit>
#include <cstring>
#include <tuple>

#include "core/error.h"
#include "core/log.h"
#include "kv/state_manager.h"
#include "model/step_sync.h"
#include "moe/make_exchange.h"

namespace bg {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The first n_rows logits rows of a step's output: [rows, vocab], or with TP the gathered [tp, rows, vocab / tp].
void download_logits(Backend& be, const Tensor& out, int32_t tp, int64_t n_rows, float* dst) {
  std::vector<float> host(static_cast<size_t>(out.numel()));
  be.download_f32(out, host.data());  // also the step's synchronisation point (device error flags)
  if (dst == nullptr || n_rows == 0) return;
  const int64_t rows = out.rows() / tp, part = out.cols();
  BG_CHECK(n_rows <= rows, "internal: {} logits rows wanted of {}", n_rows, rows);
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int32_t p = 0; p < tp; ++p) {
      std::memcpy(dst + (r * tp + p) * part, host.data() + (p * rows + r) * part, static_cast<size_t>(part) * 4);
    }
  }
}

}  // namespace

StepModel::StepModel(const LoadOptions& options)
    : ranks_(options.ranks),
      exchange_(moe::make_loopback_exchange()),
      resident_experts_(options.resident_experts),
      expert_trace_(options.expert_trace),
      graphs_(options.cuda_graphs),
      max_graph_batch_(options.max_graph_batch) {
  BG_CHECK(max_graph_batch_ >= 1 && std::has_single_bit(static_cast<uint64_t>(max_graph_batch_)),
           "max_graph_batch must be a power of two >= 1, got {}", max_graph_batch_);
  BG_CHECK(!ranks_ || (ranks_->world && ranks_->tp), "internal: a rank context without communicators");
}

void StepModel::init_exchange(int64_t n_experts, int64_t top_k, int64_t expert_hidden) {
  if (!collective()) return;  // one rank: the loopback
  exchange_ = moe::make_rank_exchange(*ranks_, backend(), placement(n_experts), top_k, expert_hidden);
}

moe::ExpertPlacement StepModel::placement(int64_t n_experts) const {
  if (!ranks_) return moe::ExpertPlacement::contiguous(n_experts, 1, 0);
  return moe::ExpertPlacement::contiguous(n_experts, ranks_->world_size(), ranks_->rank());
}

moe::ExpertResidency StepModel::plan_residency(const moe::ExpertPlacement& placement) const {
  return moe::ExpertResidency::plan(placement, resident_experts_, expert_trace_);
}

moe::StreamedExperts StepModel::streamed_experts(const moe::ExpertResidency& residency,
                                                 const moe::ExpertPlacement& placement, int64_t layer,
                                                 const std::function<moe::ExpertSource(int32_t expert)>& source) {
  moe::StreamedExperts out;
  if (!residency.streaming()) return out;
  for (int32_t e : placement.experts_of(placement.rank())) {
    if (!residency.resident(layer, e)) out.sources.emplace(e, source(e));
  }
  if (out.sources.empty()) return out;
  if (!expert_stream_) {
    const int64_t n_buffers = moe::ExpertStream::pool_buffers(residency.n_streamed_per_layer());
    expert_stream_ = std::make_unique<moe::ExpertStream>(backend(), n_buffers, out.sources.begin()->second,
                                                         placement.n_experts());
    log::info("streamed experts: {} of {} experts per MoE layer resident on this rank, a pool of {} expert buffers",
              residency.n_resident_per_layer(), placement.n_local(), expert_stream_->n_buffers());
  }
  for (const auto& [e, src] : out.sources) expert_stream_->add_host_bytes(src);
  out.stream = expert_stream_.get();
  out.layer = layer;
  return out;
}

void StepModel::pin_streamed_experts() {
  if (expert_stream_) expert_stream_->pin_host_bytes(backend());
}

Model::ExpertStreamCounters StepModel::expert_stream_counters() const {
  if (!expert_stream_) return {};
  const moe::ExpertStream::Stats& s = expert_stream_->stats();
  return {static_cast<int64_t>(s.copies), static_cast<int64_t>(s.hits), static_cast<int64_t>(s.bytes_copied),
          static_cast<int64_t>(s.prefetches), static_cast<int64_t>(s.prefetch_hits)};
}

void StepModel::tp_all_reduce(Tensor& t) const {
  if (tp_size() > 1) ranks_->tp->all_reduce_sum(backend(), t);
}

std::pair<int64_t, int64_t> StepModel::moe_rows(int64_t n) const {
  const int64_t per = ceil_div(n, tp_size()), first = std::min(n, per * tp_rank());
  return {first, std::min(per, n - first)};
}

Tensor StepModel::lm_head_logits(const LinearHandle& lm_head, const Tensor& x, bool all_rows) const {
  Backend& be = backend();
  const StepLayout& s = be.step();
  Tensor rows = x;  // [n_tokens, hidden], or each sequence's last row [n_seqs, hidden]
  if (!all_rows && !s.all_single_token()) {
    rows = be.act(s.n_seqs(), x.cols());
    be.gather_last_rows(x, rows);
  }
  Tensor out = be.alloc({rows.rows(), lm_head.n_out()}, DType::kF32);  // [rows, vocab / tp]
  be.linear(lm_head, rows, out);
  if (tp_size() == 1) return out;
  Tensor all = be.alloc({tp_size() * rows.rows(), lm_head.n_out()}, DType::kF32);  // [tp, rows, vocab / tp]
  ranks_->tp->all_gather(be, out, all);
  return all;
}

void StepModel::forward(Sequence& seq, std::span<const int32_t> tokens, float* logits, const TapFn* tap) {
  if (tokens.empty()) return;
  const BatchEntry entry{&seq, tokens};
  if (!collective()) return forward_single({&entry, 1}, true, logits, tap);
  if (!forward_ranks({&entry, 1}, {}, true, logits, tap, false)) throw dist::SetStopping("the rank set is stopping");
}

void StepModel::forward_batch(std::span<const BatchEntry> batch, float* last_logits) {
  if (!collective()) return forward_single(batch, false, last_logits, nullptr);
  if (!forward_ranks(batch, {}, false, last_logits, nullptr, false)) {
    throw dist::SetStopping("the rank set is stopping");
  }
}

// Single rank: the step's logits stay in backend memory and the backend samples them (CUDA: only ids, finite flags
// and logprobs come back). A rank set downloads them (the leader's rows, gathered over TP) and samples on the host.
void StepModel::forward_batch_sample(std::span<const BatchEntry> batch, std::span<const ops::RowSampling> rows,
                                     std::span<ops::RowSample> out) {
  if (collective()) return Model::forward_batch_sample(batch, rows, out);
  int64_t n_rows = 0;
  const Tensor logits = run_single(batch, false, nullptr, &n_rows);
  backend().sample_rows(logits.rows() > n_rows ? logits.rows_view(0, n_rows) : logits, rows, out);
  finish_step(batch);
}

bool StepModel::sync_idle(bool stop, const StepPools& pools) {
  if (!collective()) return !stop;
  return forward_ranks({}, pools, false, nullptr, nullptr, stop);
}

void StepModel::forward_single(std::span<const BatchEntry> batch, bool all_rows, float* logits, const TapFn* tap) {
  int64_t n_rows = 0;
  const Tensor out = run_single(batch, all_rows, tap, &n_rows);
  download_logits(backend(), out, tp_size(), n_rows, logits);
  finish_step(batch);
}

Tensor StepModel::run_single(std::span<const BatchEntry> batch, bool all_rows, const TapFn* tap, int64_t* n_rows) {
  const StepPools pools = step_pools_of(batch);
  StepLayout step = layout_step(batch, info(), pools);
  *n_rows = all_rows ? step.n_tokens() : step.n_seqs();
  // Decode steps on CUDA replay a graph of the next power-of-two batch (padding sequences write only the pools'
  // padding block and slot). A route hook synchronises, so it forces eager steps; so does a per-op profiler that
  // cannot record inside a graph.
  Backend& be = backend();
  const bool per_op_profile = be.profiler() != nullptr && be.profiler()->per_op() && !be.profiler()->in_graph();
  // Streamed experts wait for each layer's routing on the host: never captured.
  const bool graph_ok = !all_rows && graphs_ && !route_hook_ && !expert_stream_ && !per_op_profile &&
                        be.device() == DeviceKind::kCuda && step.all_single_token();
  const int64_t bucket = graph_ok ? graph_bucket(step.n_seqs(), max_graph_batch_) : 0;
  if (bucket > 0) pad_decode_step(step, bucket, pools);
  return run_layout(std::move(step), pools, bucket, all_rows, tap);
}

// One step as a rank of a set: vote, (TP) receive the group leader's layout, pad, run. A layout error of this rank's
// own batch is raised after the step ran empty here, so the others are not left waiting. `idle_pools`: the rank's
// pools when it has no batch (sync_idle); with a batch, its sequences' pools.
bool StepModel::forward_ranks(std::span<const BatchEntry> batch, const StepPools& idle_pools, bool all_rows,
                              float* logits, const TapFn* tap, bool stop) {
  const dist::RankContext& rc = *ranks_;
  const bool leader = rc.place.is_leader();
  BG_CHECK(leader || batch.empty(), "internal: TP rank {} of DP group {} was given work; only the group's leader "
           "schedules", rc.tp_rank(), rc.place.dp_group());
  std::string error;
  StepPools pools = idle_pools;
  StepLayout step;  // empty (what layout_step gives for no entries) unless this rank has a batch
  step.seq_begin.push_back(0);
  step.max_blocks = 1;
  try {
    if (!batch.empty()) {
      pools = step_pools_of(batch);
      step = layout_step(batch, info(), pools);
    }
  } catch (const Error& e) {
    error = e.what();
    if (pools.kv == nullptr && batch[0].seq != nullptr) pools = batch[0].seq->manager().step_pools();
  }
  if (pools.kv == nullptr && !stop) {  // no pools to pad an empty step on: the set cannot step with this rank
    rc.world->mark_failed(fmt::format("rank {}: a step without state pools ({})", rc.rank(), error));
    throw dist::RankFailure(fmt::format("rank {}: a step without state pools: {}", rc.rank(), error));
  }
  const int32_t tp = tp_size();
  // forward() (every row's logits, taps) always runs eagerly: it counts as a prefill in the vote.
  const bool eager = !step.all_single_token() || (all_rows && step.n_seqs() > 0);
  const StepAgreement a = agree_step(*rc.world, {stop, step.n_seqs(), ceil_div(step.n_tokens(), tp), eager});
  if (a.stop) {
    exchange_->quiesce();  // the peers exit now: not a failure
    return false;
  }
  if (a.any_work) {
    // A captured step needs an exchange and collectives without host round trips. The ll exchange is one; the nccl
    // exchange is not, and neither are the TP collectives (NCCL or shared memory: both synchronise the backend), so
    // decode steps are graphs only for ll rank sets without TP; every other CUDA rank set runs its steps eagerly.
    const bool graph_ok = graphs_ && exchange_->capturable() && tp == 1 && !route_hook_ && !expert_stream_ &&
                          backend().device() == DeviceKind::kCuda && !a.any_prefill;
    const int64_t bucket = graph_ok ? graph_bucket(a.max_seqs, max_graph_batch_) : 0;
    if (tp > 1) {
      std::vector<std::byte> wire = leader ? encode_step(step, all_rows) : std::vector<std::byte>{};
      rc.tp->broadcast(wire, 0);
      if (!leader) {
        step = decode_step(wire, &all_rows);
        for (int64_t s = 0; s < step.n_seqs(); ++s) {  // sequences that start now: fresh state, as on the leader
          if (!step.state_slots.empty() && step.positions[static_cast<size_t>(step.seq_begin[s])] == 0) {
            pools.state->zero_slot(step.state_slots[static_cast<size_t>(s)]);
          }
        }
      }
    }
    const int64_t n_rows = step.n_seqs() == 0 ? 0 : (all_rows ? step.n_tokens() : step.n_seqs());
    if (step.n_seqs() == 0 || bucket > 0) pad_decode_step(step, std::max<int64_t>(bucket, 1), pools);
    exchange_->set_step_tokens(std::max(a.max_moe_tokens, ceil_div(std::max<int64_t>(bucket, 1), tp)));
    try {
      const Tensor out = run_layout(std::move(step), pools, bucket, all_rows && n_rows > 0, tap);
      download_logits(backend(), out, tp, leader ? n_rows : 0, logits);
    } catch (const dist::RankFailure&) {
      throw;
    } catch (const std::exception& e) {
      // Half-way through a step the ranks cannot recover together: fail the set so nobody waits for this rank.
      rc.world->mark_failed(fmt::format("rank {}: {}", rc.rank(), e.what()));
      throw dist::RankFailure(fmt::format("rank {}: step failed: {}", rc.rank(), e.what()));
    }
  }
  if (!error.empty()) throw Error(error);
  if (!batch.empty()) finish_step(batch);
  return true;
}

Tensor StepModel::run_layout(StepLayout step, const StepPools& pools, int64_t bucket, bool all_rows, const TapFn* tap) {
  Backend& be = backend();
  const int64_t key = bucket > 0 ? (graph_pools_index(pools) << 48) | (bucket << 32) | step.max_blocks : 0;
  be.begin_step(std::move(step));
  return bucket > 0 ? be.run_graph(key, [this, &pools] { return step_body(pools, false, nullptr); })
                    : step_body(pools, all_rows, tap);
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

}  // namespace bg

// Scheduler: queueing, the per-step choice of chunks, admission, preemption and cancellation.
#include "sched/scheduler.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"

namespace bg::sched {

Scheduler::Scheduler(Model& model, const SchedulerConfig& config)
    : model_(model), config_(config), admission_(config.max_num_seqs, config.kv_watermark) {
  BG_CHECK(config_.max_num_seqs >= 1, "--max-num-seqs {} must be >= 1", config_.max_num_seqs);
  BG_CHECK(config_.max_model_len >= 2, "--max-model-len {} must be >= 2", config_.max_model_len);
  BG_CHECK(config_.chunked_prefill_size >= config_.max_num_seqs, "--chunked-prefill-size {} must be >= "
           "--max-num-seqs {} (every running sequence decodes one token per step)", config_.chunked_prefill_size,
           config_.max_num_seqs);
  BG_CHECK(config_.max_queue >= 0, "--max-queue {} must be >= 0", config_.max_queue);
  BG_CHECK(config_.kv_watermark >= 0.0 && config_.kv_watermark < 1.0, "KV watermark {} must be in [0, 1)",
           config_.kv_watermark);
}

std::optional<Rejection> Scheduler::add(std::unique_ptr<Request> request) {
  LengthDecision len = check_length(request->n_prompt, request->params.max_tokens, config_.max_model_len);
  if (!len.error.empty()) return Rejection{400, len.error};
  // The queue bound counts requests beyond those the running set still has room for.
  if (n_waiting() >= config_.max_queue + std::max<int64_t>(config_.max_num_seqs - n_running(), 0)) {
    return Rejection{503, fmt::format("the worker is full ({} running, {} waiting; --max-num-seqs {}, --max-queue {}); "
                                      "retry later", n_running(), n_waiting(), config_.max_num_seqs,
                                      config_.max_queue)};
  }
  request->max_new_tokens = len.max_new_tokens;
  waiting_.push_back(std::move(request));
  return std::nullopt;
}

std::unique_ptr<Request> Scheduler::cancel(const std::string& id) {
  auto by_id = [&](const std::unique_ptr<Request>& r) { return r->id == id; };
  if (auto it = std::find_if(running_.begin(), running_.end(), by_id); it != running_.end()) {
    std::unique_ptr<Request> r = std::move(*it);
    running_.erase(it);
    r->seq.reset();  // blocks and slot go back to the pools now
    return r;
  }
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), by_id); it != waiting_.end()) {
    std::unique_ptr<Request> r = std::move(*it);
    waiting_.erase(it);
    return r;
  }
  return nullptr;
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  TokenBudget budget(config_.chunked_prefill_size);
  schedule_decodes(plan, budget);
  schedule_prefills(plan, budget);
  admit_waiting(plan, budget);
  return plan;
}

void Scheduler::schedule_decodes(StepPlan& plan, TokenBudget& budget) {
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i]->n_pending() != 1) continue;
    if (!reserve_decode_kv(i)) break;  // the request itself was the newest and was preempted
    add_chunk(plan, *running_[i], budget.take(1));
  }
}

void Scheduler::schedule_prefills(StepPlan& plan, TokenBudget& budget) {
  for (auto& r : running_) {
    if (r->n_pending() <= 1) continue;
    const int64_t n = budget.take(r->n_pending());
    if (n == 0) break;
    add_chunk(plan, *r, n);  // blocks for the whole prompt were reserved at admission
  }
}

void Scheduler::admit_waiting(StepPlan& plan, TokenBudget& budget) {
  while (!waiting_.empty() && budget.left() > 0) {
    Request& r = *waiting_.front();
    const PoolState pools = PoolState::of(model_.memory_usage());
    if (!admission_.admit(pools, n_running(), r.n_tokens())) break;  // FIFO: the head waits, nothing overtakes it
    try {
      r.seq = model_.new_sequence();
      r.seq->reserve_kv(r.n_tokens());
    } catch (const Error& e) {
      log::warn("scheduler: could not start request {}: {}", r.id, e.what());
      r.seq.reset();
      break;
    }
    r.n_computed = 0;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    add_chunk(plan, r, budget.take(r.n_tokens()));
  }
}

bool Scheduler::reserve_decode_kv(size_t running_idx) {
  Request& r = *running_[running_idx];
  const int64_t block_tokens = std::max<int64_t>(model_.memory_usage().kv_block_tokens, 1);
  const int64_t need =
      blocks_for_tokens(r.n_computed + 1, block_tokens) - static_cast<int64_t>(r.seq->kv_blocks().size());
  while (need > 0 && model_.memory_usage().kv_blocks_free < need) {
    const size_t victim = preemption_.victim(running_.size());
    preempt(victim);
    if (victim == running_idx) return false;
  }
  r.seq->reserve_kv(r.n_computed + 1);
  return true;
}

void Scheduler::preempt(size_t running_idx) {
  std::unique_ptr<Request> r = std::move(running_[running_idx]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(running_idx));
  r->seq.reset();
  r->n_computed = 0;
  ++r->n_preemptions;
  ++preemptions_total_;
  log::debug("scheduler: preempted request {} ({} tokens to recompute)", r->id, r->n_tokens());
  waiting_.push_front(std::move(r));
}

void Scheduler::add_chunk(StepPlan& plan, Request& r, int64_t n_tokens) {
  if (n_tokens <= 0) return;
  plan.chunks.push_back({&r, r.n_computed, n_tokens, r.n_computed + n_tokens == r.n_tokens()});
  plan.n_tokens += n_tokens;
}

std::unique_ptr<Request> Scheduler::finish(const Request* request) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == request; });
  BG_CHECK(it != running_.end(), "scheduler: finishing a request that is not running");
  std::unique_ptr<Request> r = std::move(*it);
  running_.erase(it);
  r->seq.reset();
  return r;
}

void Scheduler::reset_sequence(Request& request) {
  request.seq.reset();  // first give the slot back, then take one
  request.seq = model_.new_sequence();
  request.n_computed = 0;
}

const Request* Scheduler::find(const std::string& id) const {
  for (const auto& r : running_) {
    if (r->id == id) return r.get();
  }
  for (const auto& r : waiting_) {
    if (r->id == id) return r.get();
  }
  return nullptr;
}

std::vector<std::string> Scheduler::ids() const {
  std::vector<std::string> out;
  for (const auto& r : running_) out.push_back(r->id);
  for (const auto& r : waiting_) out.push_back(r->id);
  return out;
}

}  // namespace bg::sched

// Scheduler: queueing, the per-step choice of chunks, admission, preemption and cancellation.
#include "sched/scheduler.h"

#include <algorithm>

#include "core/device_fault.h"
#include "core/error.h"
#include "core/log.h"

namespace bg::sched {

Scheduler::Scheduler(kv::StateManager& state, const SchedulerConfig& config)
    : state_(state), config_(config), admission_(config.max_num_seqs, config.kv_watermark) {
  align_ = state.geometry().prefill_align_tokens;
  split_ = state.geometry().has_state() ? state.plan().snapshot_interval : 0;
  BG_CHECK(config_.max_num_seqs >= 1, "--max-num-seqs {} must be >= 1", config_.max_num_seqs);
  BG_CHECK(config_.max_model_len >= 2, "--max-model-len {} must be >= 2", config_.max_model_len);
  BG_CHECK(config_.chunked_prefill_size >= config_.max_num_seqs, "--chunked-prefill-size {} must be >= "
           "--max-num-seqs {} (every running sequence decodes one token per step)", config_.chunked_prefill_size,
           config_.max_num_seqs);
  BG_CHECK(align_ <= 1 || config_.chunked_prefill_size >= config_.max_num_seqs + align_, "--chunked-prefill-size {} "
           "must be >= --max-num-seqs {} + {} (prefill pieces of this model are whole {}-token KDA chunks)",
           config_.chunked_prefill_size, config_.max_num_seqs, align_, align_);
  BG_CHECK(config_.idle_prefill_size == 0 || config_.idle_prefill_size >= config_.chunked_prefill_size,
           "--idle-prefill-size {} must be 0 (off) or >= --chunked-prefill-size {}", config_.idle_prefill_size,
           config_.chunked_prefill_size);
  BG_CHECK(config_.max_queue >= 0, "--max-queue {} must be >= 0", config_.max_queue);
  BG_CHECK(config_.kv_watermark >= 0.0 && config_.kv_watermark < 1.0, "KV watermark {} must be in [0, 1)",
           config_.kv_watermark);
  if (config_.deterministic) {
    // Pieces end on fixed positions: the snapshot interval (also for models without KDA layers, whose prefix-cache
    // hits are then rounded to it) and the largest multiple of the alignment that always fits beside the decodes.
    split_ = state.plan().snapshot_interval;
    grid_ = (config_.chunked_prefill_size - config_.max_num_seqs) / align_ * align_;
    BG_CHECK(grid_ >= 1 && split_ >= 1, "--deterministic needs --chunked-prefill-size {} > --max-num-seqs {} (a prefill "
             "piece must fit beside a decode token of every running sequence)", config_.chunked_prefill_size,
             config_.max_num_seqs);
  }
  BG_CHECK(config_.swap_quantum_steps >= 0, "--swap-quantum-steps {} must be >= 0", config_.swap_quantum_steps);
  BG_CHECK(config_.swap_quantum_steps == 0 || state.plan().host_bytes > 0, "--swap-quantum-steps {} needs a host "
           "tier (--host-memory-gb)", config_.swap_quantum_steps);
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
    r->seq.reset();  // blocks and slot go back to the state manager now
    return r;
  }
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), by_id); it != waiting_.end()) {
    std::unique_ptr<Request> r = std::move(*it);
    waiting_.erase(it);
    r->seq.reset();  // an offloaded request's host pages
    return r;
  }
  return nullptr;
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  TokenBudget budget(config_.chunked_prefill_size);
  rotate();
  schedule_decodes(plan, budget);
  // No decode token in this step: nobody's inter-token latency depends on its length, so prefill takes the larger
  // budget (the deterministic grid keeps its fixed pieces).
  if (plan.empty() && grid_ == 0 && config_.idle_prefill_size > config_.chunked_prefill_size) {
    budget = TokenBudget(config_.idle_prefill_size);
  }
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
    const int64_t n = budget.take(piece_tokens(*r, budget.left()));
    if (n == 0) break;
    add_chunk(plan, *r, n);  // blocks for the whole input were reserved when it started
  }
}

int64_t Scheduler::piece_tokens(const Request& r, int64_t budget) const {
  const int64_t start = r.n_computed, n = r.n_tokens();
  if (grid_ > 0) {
    int64_t end = n;
    if (split_ > 0) end = std::min(end, (start / split_ + 1) * split_);
    end = std::min(end, (start / grid_ + 1) * grid_);
    return end - start <= budget ? end - start : 0;
  }
  int64_t stop = std::min(n, start + budget);
  if (split_ > 0 && stop / split_ * split_ > start) {
    // The last snapshot position the piece reaches (a multiple of the alignment): the prefix cache keeps the state
    // there; the rest of the input, if any, is the next piece.
    return stop / split_ * split_ - start;
  }
  // A piece cut short by the budget ends on a chunk boundary (a sequence off the grid, after a failure, is left be).
  if (stop < n && start % align_ == 0) stop = stop / align_ * align_;
  return std::max<int64_t>(stop - start, 0);
}

void Scheduler::admit_waiting(StepPlan& plan, TokenBudget& budget) {
  while (!waiting_.empty() && budget.left() > 0) {
    Request& r = *waiting_.front();
    if (!start(r)) break;  // FIFO: the head waits, nothing overtakes it
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    const int64_t n = r.n_pending() == 1 ? 1 : piece_tokens(r, budget.left());
    add_chunk(plan, r, budget.take(n));
    if (n == 0 && grid_ > 0) break;  // deterministic: its first piece waits for the next step, and so do the requests behind it
  }
}

// Whether the GPU tier can take `r` now (a restore needs blocks for all its tokens; a new request what the prefix
// cache does not already hold on the GPU).
bool Scheduler::fits(const Request& r) const {
  const PoolState pools = PoolState::of(state_.usage());
  if (r.offloaded()) {
    return admission_.admit_blocks(pools, n_running(), blocks_for_tokens(r.n_tokens(), pools.block_tokens));
  }
  const kv::StartPlan sp = state_.plan_start(r.tokens);
  return admission_.admit_blocks(pools, n_running(), sp.blocks_needed + sp.blocks_pinned);
}

// Time slicing over the host tier: while the head of the queue cannot start, the request resident longest (with its
// quantum spent) goes to the host tier and the back of the queue.
void Scheduler::rotate() {
  if (config_.swap_quantum_steps == 0) return;
  while (!waiting_.empty() && !fits(*waiting_.front())) {
    size_t victim = running_.size();
    for (size_t i = 0; i < running_.size(); ++i) {
      if (running_[i]->steps_resident < config_.swap_quantum_steps) continue;
      if (victim == running_.size() || running_[i]->steps_resident > running_[victim]->steps_resident) victim = i;
    }
    if (victim == running_.size() || !state_.offload(*running_[victim]->seq)) return;
    std::unique_ptr<Request> r = std::move(running_[victim]);
    running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(victim));
    ++rotations_total_;
    log::debug("scheduler: request {} yields its GPU place after {} steps", r->id, r->steps_resident);
    waiting_.push_back(std::move(r));
  }
}

// Gives the head of the queue a runnable sequence: an offloaded one comes back from the host tier, a new one starts
// from the longest usable prefix in the cache. False when the GPU tier cannot take it now.
bool Scheduler::start(Request& r) {
  if (!fits(r)) return false;
  r.steps_resident = 0;
  try {
    if (r.offloaded()) {
      state_.restore(*r.seq);
      state_.reserve(*r.seq, r.n_tokens());
      return true;
    }
    r.seq = state_.start_sequence(r.tokens);
  } catch (const DeviceFault&) {
    throw;  // not a lack of memory: the device context is lost (the worker restarts)
  } catch (const Error& e) {
    log::warn("scheduler: could not start request {}: {}", r.id, e.what());
    if (!r.offloaded()) r.seq.reset();
    return false;
  }
  r.n_computed = r.seq->n_past();
  r.n_input = r.n_tokens();
  if (r.n_cached < 0) r.n_cached = std::min(r.seq->n_cached(), r.n_prompt);
  return true;
}

bool Scheduler::reserve_decode_kv(size_t running_idx) {
  Request& r = *running_[running_idx];
  while (!state_.try_reserve(*r.seq, r.n_computed + 1)) {
    const size_t victim = preemption_.victim(running_.size());
    preempt(victim);
    if (victim == running_idx) return false;
  }
  return true;
}

void Scheduler::preempt(size_t running_idx) {
  std::unique_ptr<Request> r = std::move(running_[running_idx]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(running_idx));
  ++r->n_preemptions;
  ++preemptions_total_;
  if (state_.offload(*r->seq)) {
    log::debug("scheduler: preempted request {} to the host tier ({} tokens kept)", r->id, r->n_computed);
  } else {
    r->seq.reset();
    r->n_computed = 0;
    ++recomputes_total_;
    log::debug("scheduler: preempted request {} ({} tokens to recompute)", r->id, r->n_tokens());
  }
  waiting_.push_front(std::move(r));
}

void Scheduler::add_chunk(StepPlan& plan, Request& r, int64_t n_tokens) {
  if (n_tokens <= 0) return;
  plan.chunks.push_back({&r, r.n_computed, n_tokens, r.n_computed + n_tokens == r.n_tokens()});
  plan.n_tokens += n_tokens;
}

void Scheduler::complete(const Chunk& chunk) {
  Request& r = *chunk.req;
  r.n_computed += chunk.n_tokens;
  ++r.steps_resident;
  state_.commit(*r.seq, r.tokens, r.n_input);
}

std::unique_ptr<Request> Scheduler::finish(const Request* request) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == request; });
  BG_CHECK(it != running_.end(), "scheduler: finishing a request that is not running");
  std::unique_ptr<Request> r = std::move(*it);
  running_.erase(it);
  r->seq.reset();
  return r;
}

void Scheduler::reset_sequence(Request& request, int64_t n_tokens) {
  request.seq.reset();  // first give the slot back, then take one
  request.seq = state_.new_sequence();
  state_.reserve(*request.seq, n_tokens);
  request.n_computed = 0;
  request.n_input = 0;  // recomputed in one piece: not shared
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

const Request* Scheduler::longest_running() const {
  const Request* best = nullptr;
  for (const auto& r : running_) {
    if (best == nullptr || r->seq->n_past() > best->seq->n_past()) best = r.get();
  }
  return best;
}

std::vector<std::string> Scheduler::ids() const {
  std::vector<std::string> out;
  for (const auto& r : running_) out.push_back(r->id);
  for (const auto& r : waiting_) out.push_back(r->id);
  return out;
}

}  // namespace bg::sched

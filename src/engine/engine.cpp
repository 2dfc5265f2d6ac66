// Engine: request intake, the step (schedule -> execute -> sample -> postprocess), failure isolation, events.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <random>

#include "core/device_fault.h"
#include "core/error.h"
#include "core/log.h"
#include "dist/comm.h"
#include "model/forward_common.h"

namespace bg::engine {

proto::TokenEvent error_event(const std::string& id, int32_t code, const std::string& message, int64_t prompt_tokens,
                              int64_t completion_tokens) {
  proto::TokenEvent ev;
  ev.id = id;
  ev.finish_reason = "error";
  ev.error = message;
  ev.error_code = code;
  ev.prompt_tokens = prompt_tokens;
  ev.completion_tokens = completion_tokens;
  return ev;
}

Engine::Engine(std::unique_ptr<Model> model, const kv::StatePlan& state_plan, const sched::SchedulerConfig& config)
    : model_(std::move(model)),
      state_(model_->backend(), model_->state_geometry(), state_plan),
      scheduler_(state_, config) {
  BG_CHECK(config.max_model_len <= model_->info().max_position_embeddings,
           "--max-model-len {} exceeds the model's context (max_position_embeddings {})", config.max_model_len,
           model_->info().max_position_embeddings);
}

bool Engine::step() {
  sched::StepPlan plan = scheduler_.schedule();  // decode tokens first, then prefill chunks within the budget
  if (plan.empty()) {
    // One rank of a set: take part in the step anyway (another rank may have work; the collectives must meet).
    if (model_->collective() && !model_->sync_idle(false, state_.step_pools())) {
      throw dist::SetStopping("the rank set is stopping");
    }
    return false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Outcome> outcomes = execute(plan);  // one forward_batch_sample: the step and its sampling
  const auto t1 = std::chrono::steady_clock::now();
  apply_samples(plan, outcomes);                  // a token for each chunk that ends its request's input
  postprocess(plan, outcomes);                    // events; finished and failed requests free their sequences
  if (spdlog::should_log(spdlog::level::debug)) {
    const auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    int64_t n_decode = 0;
    for (const sched::Chunk& c : plan.chunks) n_decode += c.n_tokens == 1 && c.start > 0 ? 1 : 0;
    log::debug("engine: step {}: {} chunks ({} single-token), {} tokens, forward+sample {:.2f} ms, after {:.2f} ms",
               stats_.steps_total, plan.chunks.size(), n_decode, plan.n_tokens, ms(t0, t1),
               ms(t1, std::chrono::steady_clock::now()));
  }
  ++stats_.steps_total;
  stats_.last_batch_size = static_cast<int64_t>(plan.chunks.size());
  stats_.last_batch_tokens = plan.n_tokens;
  return true;
}

int64_t Engine::warm_up_prefill_tokens() const {
  const sched::SchedulerConfig& cfg = scheduler_.config();
  return cfg.deterministic ? cfg.chunked_prefill_size : std::max(cfg.chunked_prefill_size, cfg.idle_prefill_size);
}

int64_t Engine::warm_up() {
  BG_CHECK(!model_->collective(), "engine: warm-up runs on a single rank only");
  const sched::SchedulerConfig& cfg = scheduler_.config();
  const int64_t vocab = model_->info().vocab_size;
  int64_t steps = 0, round = 0;
  auto run = [&](int64_t n_requests, int64_t prompt_len, int64_t max_tokens) {
    for (int64_t k = 0; k < n_requests; ++k) {
      proto::GenerateRequest r;
      r.id = fmt::format("warmup-{}-{}", round, k);
      r.prompt.resize(static_cast<size_t>(prompt_len));
      for (int64_t i = 0; i < prompt_len; ++i) {
        r.prompt[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 1) % vocab);
      }
      r.params.temperature = 0.0f;
      r.params.max_tokens = max_tokens;
      submit(std::move(r));
    }
    while (has_work() && step()) ++steps;
    for (const proto::TokenEvent& e : take_events()) {
      BG_CHECK(e.finish_reason != "error", "engine: warm-up request {} failed: {}", e.id, e.error);
    }
    ++round;
  };
  const int64_t block = state_.plan().kv_block_tokens;
  const int64_t longest = cfg.max_model_len - 2;  // room for the generated tokens
  if (longest < 1) return 0;
  // Prefill: requests of the longest prompt a step holds, enough to fill the largest step (one without decodes), so
  // its workspaces are allocated and a step that does not fit fails here, before "ready".
  const int64_t step_tokens = warm_up_prefill_tokens();
  const int64_t prefill = std::min(step_tokens, longest);
  run(std::min((step_tokens + prefill - 1) / prefill, cfg.max_num_seqs), prefill, 1);
  // Decode: one batch per graph bucket up to max_num_seqs (each captures its graph), then max_num_seqs itself.
  for (int64_t b = 1;; b = std::min(graph_bucket(b + 1, std::numeric_limits<int64_t>::max()), cfg.max_num_seqs)) {
    run(b, std::min(block + 1, longest), 2);
    if (b == cfg.max_num_seqs) break;
  }
  model_->backend().wait_for_plans();  // the warm-up's buckets are built before the server reports ready
  stats_ = EngineStats{};
  return steps;
}

// Each chunk that ends its request's input gets a sampling row, its uniform drawn now from the request's own
// generator (so the draws do not depend on the batch, and a rerun in isolate_failure reuses them).
std::vector<Engine::Outcome> Engine::execute(const sched::StepPlan& plan) {
  std::vector<Outcome> outcomes(plan.chunks.size());
  std::vector<BatchEntry> batch;
  batch.reserve(plan.chunks.size());
  rows_.clear();
  row_of_chunk_.assign(plan.chunks.size(), -1);
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const sched::Chunk& c = plan.chunks[i];
    batch.push_back({c.req->seq.get(), c.req->span(c.start, c.n_tokens)});
    if (!c.samples) continue;
    row_of_chunk_[i] = static_cast<int32_t>(rows_.size());
    rows_.push_back(row_sampling(c.req->params, static_cast<int32_t>(i), c.req->rng));
  }
  samples_.assign(rows_.size(), ops::RowSample{});
  try {
    model_->forward_batch_sample(batch, rows_, samples_);
  } catch (const DeviceFault&) {
    throw;  // the device context is lost: no rerun can succeed (the worker restarts)
  } catch (const dist::RankFailure&) {
    throw;  // the rank set failed: nothing on this rank can continue
  } catch (const dist::SetStopping&) {
    throw;
  } catch (const std::exception& e) {
    isolate_failure(plan, e.what(), outcomes);
  }
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    if (outcomes[i].error.empty()) scheduler_.complete(plan.chunks[i]);
  }
  stats_.computed_tokens_total += plan.n_tokens;
  return outcomes;
}

// The batch threw: which sequences advanced is unknown, so each request recomputes its tokens up to the end of its
// chunk alone on a fresh sequence (sampling with the uniform already drawn); those that fail alone are the culprits
// and get finish_reason "error".
void Engine::isolate_failure(const sched::StepPlan& plan, const std::string& what, std::vector<Outcome>& outcomes) {
  // One request, or a rank of a set (a rerun would be a step of its own that the other ranks do not take part in):
  // the whole step's requests fail.
  if (plan.chunks.size() == 1 || model_->collective()) {
    for (Outcome& o : outcomes) o.error = what;
    return;
  }
  log::warn("engine: a batch of {} requests failed ({}); rerunning each alone", plan.chunks.size(), what);
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const sched::Chunk& c = plan.chunks[i];
    try {
      scheduler_.reset_sequence(*c.req, c.start + c.n_tokens);
      const BatchEntry alone{c.req->seq.get(), c.req->span(0, c.start + c.n_tokens)};
      const int32_t k = row_of_chunk_[i];
      ops::RowSampling row = k >= 0 ? rows_[static_cast<size_t>(k)] : ops::RowSampling{};
      row.row = 0;
      const size_t n_rows = k >= 0 ? 1 : 0;
      model_->forward_batch_sample(std::span<const BatchEntry>(&alone, 1), std::span(&row, n_rows),
                                   k >= 0 ? std::span(&samples_[static_cast<size_t>(k)], 1)
                                          : std::span<ops::RowSample>());
      c.req->n_computed = c.start;  // complete() adds the chunk
    } catch (const DeviceFault&) {
      throw;
    } catch (const std::exception& e) {
      outcomes[i].error = e.what();
    }
  }
}

void Engine::apply_samples(const sched::StepPlan& plan, std::vector<Outcome>& outcomes) {
  const int64_t vocab = model_->info().vocab_size;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const sched::Chunk& c = plan.chunks[i];
    Outcome& o = outcomes[i];
    if (!o.error.empty() || !c.samples) continue;
    sched::Request& r = *c.req;
    const ops::RowSample& s = samples_[static_cast<size_t>(row_of_chunk_[i])];
    if (!s.finite) {  // fail this request only; the others of the step are unaffected
      o.error = "the model produced non-finite logits (NaN or Inf) for this request; its output was discarded";
      continue;
    }
    if (s.token < 0 || s.token >= vocab) {
      o.error = fmt::format("sampling returned token {} (the backend rejected the request's sampling parameters)",
                            s.token);
      continue;
    }
    o.sampled = Sampled{s.token, std::nullopt};
    if (r.params.top_logprobs >= 0) o.sampled->logprob = to_token_logprob(s);
    r.tokens.push_back(s.token);
    ++stats_.generation_tokens_total;
    o.finish_reason = finish_reason_after(r.params, model_->info().eos_token_id, s.token, r.n_generated(),
                                          r.max_new_tokens);
  }
}

void Engine::postprocess(const sched::StepPlan& plan, std::vector<Outcome>& outcomes) {
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const sched::Request* r = plan.chunks[i].req;
    Outcome& o = outcomes[i];
    if (o.error.empty() && !o.sampled) continue;  // a prefill chunk that did not finish the prompt
    proto::TokenEvent ev;
    if (!o.error.empty()) {
      log::error("engine: request {} failed: {}", r->id, o.error);
      ev = error_event(r->id, 500, o.error, r->n_prompt, r->n_generated());
    } else {
      ev.id = r->id;
      ev.prompt_tokens = r->n_prompt;
      ev.cached_tokens = std::max<int64_t>(r->n_cached, 0);
      ev.completion_tokens = r->n_generated();
      ev.tokens.push_back(o.sampled->token);
      if (o.sampled->logprob) ev.logprobs.push_back(std::move(*o.sampled->logprob));
      ev.finish_reason = o.finish_reason;
    }
    outbox_.push_back(std::move(ev));
    if (!outbox_.back().finish_reason.empty()) scheduler_.finish(r);
  }
}

std::string Engine::validate(const proto::GenerateRequest& request) const {
  if (request.id.empty()) return "request id must not be empty";
  if (scheduler_.find(request.id) != nullptr) return fmt::format("request id '{}' is already in use", request.id);
  if (request.prompt.empty()) return "prompt must not be empty";
  const int64_t vocab = model_->info().vocab_size;
  for (int32_t id : request.prompt) {
    if (id < 0 || id >= vocab) return fmt::format("prompt token id {} is outside [0, {})", id, vocab);
  }
  return validate_sampling(request.params, vocab);
}

void Engine::submit(proto::GenerateRequest request) {
  if (std::string error = validate(request); !error.empty()) return reject(request, 400, error);
  auto r = std::make_unique<sched::Request>();
  r->id = request.id;
  r->n_prompt = static_cast<int64_t>(request.prompt.size());
  r->tokens = std::move(request.prompt);
  r->params = std::move(request.params);
  r->rng.seed(r->params.seed ? *r->params.seed : std::random_device{}());
  r->arrival = n_arrived_++;
  const int64_t n_prompt = r->n_prompt;
  if (auto rejection = scheduler_.add(std::move(r))) return reject(request, rejection->code, rejection->message);
  stats_.prompt_tokens_total += n_prompt;
}

void Engine::reject(const proto::GenerateRequest& request, int32_t code, const std::string& message) {
  log::info("engine: rejected request '{}' ({}): {}", request.id, code, message);
  outbox_.push_back(error_event(request.id, code, message, static_cast<int64_t>(request.prompt.size())));
}

void Engine::cancel(const std::string& id) {
  std::unique_ptr<sched::Request> r = scheduler_.cancel(id);
  if (!r) {
    log::debug("engine: cancel of unknown request '{}' ignored", id);
    return;
  }
  proto::TokenEvent ev;
  ev.id = r->id;
  ev.finish_reason = "abort";
  ev.prompt_tokens = r->n_prompt;
  ev.completion_tokens = r->n_generated();
  outbox_.push_back(std::move(ev));
}

void Engine::fail_all(const std::string& message, int32_t code) {
  for (const std::string& id : scheduler_.ids()) {
    std::unique_ptr<sched::Request> r = scheduler_.cancel(id);
    outbox_.push_back(error_event(r->id, code, message, r->n_prompt, r->n_generated()));
  }
}

std::vector<proto::TokenEvent> Engine::take_events() {
  std::vector<proto::TokenEvent> out;
  out.swap(outbox_);
  return out;
}

void Engine::fill_status(proto::WorkerStatus& s) const {
  const ModelInfo& info = model_->info();
  const kv::StateUsage m = state_.usage();
  s.arch = info.arch;
  s.vocab_size = info.vocab_size;
  s.max_model_len = scheduler_.config().max_model_len;
  s.eos_token_id = info.eos_token_id;
  s.max_num_seqs = scheduler_.config().max_num_seqs;
  s.running = scheduler_.n_running();
  s.waiting = scheduler_.n_waiting();
  s.last_batch_size = stats_.last_batch_size;
  s.last_batch_tokens = stats_.last_batch_tokens;
  s.kv_blocks_total = m.kv_blocks_total;
  s.kv_blocks_free = m.kv_blocks_free;
  s.kv_block_tokens = m.kv_block_tokens;
  s.kv_bytes = m.kv_bytes;
  s.state_slots_total = m.state_slots_total;
  s.state_slots_free = m.state_slots_free;
  s.state_bytes = m.state_bytes;
  s.kv_bytes_used = m.kv_bytes_used;
  s.state_bytes_used = m.state_bytes_used;
  s.kv_blocks_cached = m.kv_blocks_cached;
  s.state_slots_cached = m.state_slots_cached;
  s.host_bytes_total = m.host_bytes_total;
  s.host_kv_bytes = m.host_kv_bytes;
  s.host_state_bytes = m.host_state_bytes;
  s.seqs_offloaded = m.seqs_offloaded;
  const sched::Request* longest = scheduler_.longest_running();
  s.longest_seq_tokens = longest != nullptr ? longest->seq->n_past() : 0;
  s.longest_seq_gpu_bytes = longest != nullptr ? state_.gpu_bytes_of(*longest->seq) : 0;
  s.prefix_cache_lookups_total = m.cache_lookups;
  s.prefix_cache_hits_total = m.cache_hits;
  s.prefix_cache_lookup_tokens_total = m.cache_lookup_tokens;
  s.prefix_cache_hit_tokens_total = m.cache_hit_tokens;
  s.offloads_total = m.offloads;
  s.restores_total = m.restores;
  s.prompt_tokens_total = stats_.prompt_tokens_total;
  s.generation_tokens_total = stats_.generation_tokens_total;
  s.preemptions_total = scheduler_.preemptions_total();
  s.rotations_total = scheduler_.rotations_total();
  s.steps_total = stats_.steps_total;
  const Model::ExpertStreamCounters e = model_->expert_stream_counters();
  s.expert_copies_total = e.copies;
  s.expert_pool_hits_total = e.hits;
  s.expert_bytes_copied_total = e.bytes_copied;
  s.expert_prefetches_total = e.prefetches;
  s.expert_prefetch_hits_total = e.prefetch_hits;
}

}  // namespace bg::engine
